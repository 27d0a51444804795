"""The documentation: MkDocs builds the site strictly (a broken link or anchor fails the build), the
README's links into docs/ resolve, the README's port of a torchrun script runs and trains as the
torchrun loop does, and headless Chromium draws the pages with their theme, navigation and code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rlaunch.store.embedded import free_port

pytestmark = pytest.mark.timeout(300)  # two site builds and a browser, on a shared machine

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about MkDocs 2, on every build


def mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site``, from another directory than the repo's."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=site.parent, env=ENV, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("the docs test needs the docs tools: scripts/setup.sh installs them (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("docs") / "site"
    res = mkdocs(REPO / "mkdocs.yml", out)
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout}\n{res.stderr}"
    assert "WARNING" not in res.stderr, res.stderr
    return out


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strictness is the config's: the same config over pages with a broken link and a broken
    anchor must fail, naming both (a build that only passes proves nothing about them)."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "rlaunch").symlink_to(REPO / "rlaunch")  # the API reference reads the source
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\n[gone](no-such-page.md) and [anchor](faults.md#no-such-anchor)\n")
    res = mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0, "a broken link and a broken anchor did not fail the strict build"
    assert "no-such-page.md" in res.stderr and "#no-such-anchor" in res.stderr, res.stderr


def test_the_site_has_every_page_and_the_api_reference(site: Path) -> None:
    pages = sorted(p.stem for p in (REPO / "docs").glob("*.md"))
    assert {"index", "porting", "runtime", "reference", "layouts", "faults", "operations", "security",
            "architecture", "benchmarks"} <= set(pages), pages  # fmt: skip
    for name in pages:
        assert (site / f"{name}.html").is_file(), f"docs/{name}.md was not built"
    reference = (site / "reference.html").read_text()
    for anchor in ("rlaunch.init", "rlaunch.runtime.runtime.Runtime.optimizer_step",
                   "rlaunch.runtime.runtime.Runtime.device_mesh", "rlaunch.runtime.runtime.Runtime.epochs",
                   "rlaunch.runtime.data.EpochLoader.batch", "rlaunch.runtime.vote.RefusedError",
                   "rlaunch.lightning.strategy.Strategy", "rlaunch.accelerate.prepare"):  # fmt: skip
        assert f'id="{anchor}"' in reference, f"the API reference has no entry {anchor}"
    assert "Join the per-step vote, then step every optimizer" in reference  # a docstring, rendered
    assert ":class:" not in reference and ":mod:" not in reference, "a Sphinx role was left in the reference"


def test_every_table_row_is_drawn_as_a_table(site: Path) -> None:
    """A paragraph inside a Markdown table ends it: the rows after it are drawn as text starting with
    '|' (the strict build does not see that)."""
    for page in sorted(site.glob("*.html")):
        text = re.sub(r"<pre.*?</pre>", "", page.read_text(), flags=re.S)
        rows = re.findall(r"^\|.*$", text, flags=re.M)
        assert not rows, f"{page.name}: table rows drawn as text (a paragraph inside the table?): {rows[:2]}"


def test_the_readme_links_resolve_in_the_site(site: Path) -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) >= 10, links
    for path, anchor in links:
        assert (REPO / path).is_file(), f"the README links to {path}, which does not exist"
        if anchor:
            page = (site / Path(path).relative_to("docs").with_suffix(".html")).read_text()
            assert f'id="{anchor}"' in page, f"the README links to {path}#{anchor}, an anchor that page lacks"


def test_the_readme_port_trains_as_the_torchrun_loop(tmp_path: Path) -> None:
    """The README's ten lines, as written, under torchrun's environment (world size 1): the model
    ends bit-identical to the torchrun loop it replaces."""
    readme = (REPO / "README.md").read_text()
    port = re.search(r"## Port a torchrun script\n.*?```python\n(.*?)```", readme, re.S)
    assert port, "the README has no python block under '## Port a torchrun script'"
    assert len(port.group(1).strip().splitlines()) <= 10
    script = tmp_path / "port.py"
    script.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "x, y, total_steps, loss_fn = torch.randn(5, 8, 4), torch.randn(5, 8, 1), 5, nn.functional.mse_loss\n"
        "def Net():\n    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 1))\n"
        "start = torch.get_rng_state()\n"
        + port.group(1)
        + "torch.set_rng_state(start)\ninitial = Net()\n"  # the weights the port started from
        "torch.set_rng_state(start)\n"  # and the same loop as a torchrun script writes it
        "plain = DDP(Net())\nplain_opt = torch.optim.AdamW(plain.parameters())\n"
        "for step in range(total_steps):\n"
        "    loss = loss_fn(plain(x[step]), y[step])\n"
        "    plain_opt.zero_grad(); loss.backward()\n"
        "    plain_opt.step()\n"
        "same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))\n"
        "moved = not any(torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters()))\n"
        "print('port', rt.step, same, moved)\n"
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    env.pop("RLAUNCH_AGENT_ADDR", None)
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "port 4 True True" in res.stdout, res.stdout + res.stderr[-3000:]


def test_chromium_draws_the_pages(site: Path, tmp_path: Path) -> None:
    """A page with navigation and a code block, drawn by a browser: the theme's header and
    sidebar, and a highlighted code block (the stylesheets and the highlighter took effect)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert chromium, "the docs' screenshot test needs chromium (apt-get install -y chromium; .ci/run installs it)"
    shot = tmp_path / "runtime.png"
    subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000",
         "--virtual-time-budget=5000", f"--user-data-dir={tmp_path / 'chromium'}", f"--screenshot={shot}",
         (site / "runtime.html").as_uri()],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert shot.is_file(), "chromium wrote no screenshot"
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert pixels.shape[:2] == (1000, 1400)
    assert pixels.std() > 20, "the screenshot is nearly uniform"

    header = float(np.all(np.abs(pixels[:40] - np.array([0x40, 0x51, 0xB5])) <= 3, axis=-1).mean())
    assert header > 0.9, f"the header bar is {header:.3f} indigo: the theme's stylesheet did not apply"
    sidebar = pixels[90:600, :260]  # the navigation: dark text on white, on the left
    text = float((sidebar.mean(axis=-1) < 140).mean())
    assert text > 0.01, f"only {text:.4f} of the sidebar is text: the navigation did not render"
    # The first code block (the runtime loop): a band of the code background (#f5f5f5) across the
    # content, with text in it and its keywords in the highlighter's blue (#3f6ec6, "for", "in").
    code = np.all(np.abs(pixels - np.array([0xF5, 0xF5, 0xF5])) <= 1, axis=-1)
    band = np.flatnonzero(code.mean(axis=1) > 0.3)
    assert band.size, "no code block was drawn"
    runs = np.split(band, np.flatnonzero(np.diff(band) > 1) + 1)
    rows = max(runs, key=len)
    cols = np.flatnonzero(code[rows].mean(axis=0) > 0.5)
    assert len(rows) > 100 and len(cols) > 400, f"the code block is {len(cols)} x {len(rows)} pixels: too small"
    block = pixels[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    text = float((block.mean(axis=-1) < 128).mean())
    assert text > 0.01, f"only {text:.4f} of the code block is text"
    blue = int(((block[..., 2] - block[..., 0]) > 60).sum())
    assert blue >= 10, f"{blue} pixels of the code block are the keywords' blue: the highlighting was not drawn"
    html = (site / "runtime.html").read_text()
    assert '<span class="k">for</span>' in html, "the highlighter did not mark the code's keywords"
