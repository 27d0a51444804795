"""Unit tests of the etcd security settings: flags against schemes, files, users, and error sentences."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlaunch.errors import UsageError
from rlaunch.store.certs import CertificateAuthority, write_private
from rlaunch.store.client import Endpoint, access_problem, parse_endpoints
from rlaunch.store.security import EtcdSecurity, resolve_security


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority()
    client = ca.issue("me", server=False)
    other = ca.issue("other", server=False)
    out = {"ca": tmp / "ca.pem", "cert": tmp / "c.pem", "key": tmp / "c-key.pem", "other-key": tmp / "o-key.pem"}
    write_private(out["ca"], ca.pem)
    write_private(out["cert"], client.cert)
    write_private(out["key"], client.key)
    write_private(out["other-key"], other.key)
    (tmp / "junk.pem").write_text("not a certificate\n")
    return {k: str(v) for k, v in out.items()} | {"junk": str(tmp / "junk.pem")}


def resolve(endpoints: str, **kw: str | None) -> EtcdSecurity:
    return resolve_security(parse_endpoints(endpoints), environ={}, **kw)  # type: ignore[arg-type]


def test_plain_endpoints_without_flags_are_plaintext() -> None:
    assert resolve("10.0.0.1:2379") == EtcdSecurity()


def test_https_without_a_ca_is_tls_with_the_system_roots() -> None:
    sec = resolve("https://etcd:2379")
    assert sec.tls and sec.cacert is None
    assert "system's root certificates" in sec.describe()


def test_tls_files_on_bare_endpoints_turn_tls_on(files: dict[str, str]) -> None:
    sec = resolve("etcd:2379", cacert=files["ca"], cert=files["cert"], key=files["key"])
    assert sec.tls and sec.flags() == ["--cacert", files["ca"], "--cert", files["cert"], "--key", files["key"]]


def test_http_with_tls_files_is_refused(files: dict[str, str]) -> None:
    with pytest.raises(UsageError, match=r"http:// \(plaintext\), but --cacert asks for TLS"):
        resolve("http://etcd:2379", cacert=files["ca"])


def test_mixed_schemes_are_refused() -> None:
    with pytest.raises(UsageError, match="mix http:// and https://"):
        resolve("http://a:2379,https://b:2379")


def test_a_certificate_needs_its_key(files: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="--cert was given without --key"):
        resolve("https://etcd:2379", cert=files["cert"])


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(UsageError, match="does not exist") as info:
        resolve("https://etcd:2379", cacert=missing)
    assert repr(missing) in str(info.value)


def test_a_file_that_is_no_certificate_is_named(files: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="holds no usable PEM certificate"):
        resolve("https://etcd:2379", cacert=files["junk"])


def test_a_key_that_does_not_belong_to_the_certificate_is_named(files: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="could not be loaded together"):
        resolve("https://etcd:2379", cert=files["cert"], key=files["other-key"])


def test_user_and_password() -> None:
    sec = resolve("etcd:2379", user="alice:pa:ss")
    assert (sec.user, sec.password) == ("alice", "pa:ss")
    assert "pa:ss" not in repr(sec)


def test_user_without_password_takes_etcdctl_password() -> None:
    sec = resolve_security(parse_endpoints("etcd:2379"), user="alice", environ={"ETCDCTL_PASSWORD": "pw"})
    assert (sec.user, sec.password) == ("alice", "pw")


def test_user_without_any_password_is_refused() -> None:
    with pytest.raises(UsageError, match="ETCDCTL_PASSWORD"):
        resolve("etcd:2379", user="alice")


EP = Endpoint("10.0.0.5", 2379)


@pytest.mark.parametrize(
    ("error", "security", "phrase"),
    [
        ("Tls handshake failed: CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
         EtcdSecurity(tls=True, cacert="/ca.pem"), "the CA in --cacert /ca.pem cannot verify"),
        ("Tls handshake failed: SSLV3_ALERT_BAD_CERTIFICATE", EtcdSecurity(tls=True, cert="/c.pem", key="/k"),
         "rejected this client's TLS certificate /c.pem"),
        ("Tls handshake failed: SSLV3_ALERT_BAD_CERTIFICATE", EtcdSecurity(tls=True), "requires a TLS client"),
        ("Handshake read failed (recvmsg:Connection reset by peer)", EtcdSecurity(tls=True), "it may serve plaintext"),
        ("etcdserver: authentication failed, invalid user ID or password", EtcdSecurity(user="bob", password="x"),
         "user name or password of user 'bob'"),
        ("etcdserver: user name is empty", EtcdSecurity(), "pass --user USER:PASSWORD"),
        ("etcdserver: permission denied", EtcdSecurity(user="bob", password="x"), "grant-permission"),
    ],
)  # fmt: skip
def test_access_problems_are_sentences_naming_the_endpoint(error: str, security: EtcdSecurity, phrase: str) -> None:
    sentence = access_problem(EP, security, error)
    assert sentence is not None and phrase in sentence and "10.0.0.5:2379" in sentence


def test_an_outage_is_no_access_problem() -> None:
    assert access_problem(EP, EtcdSecurity(tls=True), "failed to connect to all addresses; Connection refused") is None
    assert access_problem(EP, EtcdSecurity(), "Socket closed") is None
