"""A loop the script writes over a framework's objects: where the vote goes, and what refuses moves."""

from __future__ import annotations

import datetime

import torch
from torch.distributed import HashStore
from torch.utils.data import Dataset, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from rlaunch.runtime.data import EpochLoader
from rlaunch.runtime.groups import SandboxComm
from rlaunch.runtime.runtime import Runtime
from rlaunch.userloop import LOOP_REFUSAL, LoopData, UserLoop


def _runtime() -> Runtime:
    return Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_vote_is_cast_inside_rt_steps_and_an_optimizer_stepped_outside_refuses_moves() -> None:
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    stepped: list[int] = []
    for step in rt.steps(2):
        model(torch.ones(1, 2)).sum().backward()
        assert loop.vote(opt, None, lambda s=step: stepped.append(s)) is True
    assert stepped == [] and rt._s.refused == "", "voted and applied by the runtime"
    loop.vote(opt, None, lambda: stepped.append(9))
    assert stepped == [9], "outside rt.steps() the step is applied as the framework would"
    assert rt._s.refused.startswith("rlaunch.test: The optimizer stepped outside rt.steps()")


def test_an_accumulation_window_spanning_two_steps_refuses_moves() -> None:
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    for step in rt.steps(3):
        model(torch.ones(1, 2)).sum().backward()
        if step == 0:
            loop.micro_step()
            loop.micro_step()
            loop.vote(opt, None, opt.step)  # a window inside one step: carried
            assert rt._s.refused == ""
        elif step == 1:
            loop.micro_step()  # its optimizer step comes in the next step
        else:
            loop.vote(opt, None, opt.step)
    assert "A gradient-accumulation window spans several steps of rt.steps()" in rt._s.refused


def test_a_loop_over_the_loaders_epochs_refuses_moves_and_drives_the_steps() -> None:
    """The framework's tutorial loop: a loader iterated as it is, an optimizer step outside rt.steps()."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    data = loop.data(None, [torch.ones(1, 2)] * 3, lambda b: b, 3, "unused")
    steps = []
    for _epoch in range(2):
        for batch in data:
            model(batch).sum().backward()
            loop.vote(opt, None, opt.step)
            steps.append(rt.step if rt.in_step else None)
    assert steps == [0, 1, 2, 3, 4, 5], "the first vote begins a runtime step, then each read after a vote does"
    assert rt._s.refused == f"rlaunch.test: {LOOP_REFUSAL}"
    loop.end()


class Batches:
    """A tiny StatefulDataLoader over numbered rows, with a DistributedSampler (its ``rank`` is a rank's part)."""

    def __init__(self, rank: int = 0) -> None:
        dataset = TensorDataset(torch.arange(16.0).reshape(8, 2))
        self.sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        self.loader = StatefulDataLoader(dataset, batch_size=2, sampler=self.sampler)


def _data(
    rt: Runtime, loop: UserLoop, made: list[str], order_rng: torch.Generator | None = None
) -> tuple[LoopData, Batches]:
    """A prepared loader; ``made`` gets each loader's name as its ``rt.epochs`` is made (with `` alone``
    when made where a position landed, not by every rank at the first ``batch()``). Made by every rank,
    it sets ``order_rng`` as Accelerate's broadcast of rank 0's shuffling generator does."""
    batches = Batches()

    def epochs(name: str, together: bool) -> EpochLoader:
        made.append(name if together else f"{name} alone")
        if together and order_rng is not None:
            order_rng.manual_seed(99)
        return rt.epochs(batches.loader, sampler=batches.sampler, name=name, track=False, order_rng=order_rng)

    data = loop.data(epochs, batches.loader, lambda b: b, len(batches.loader), "", batches.sampler, order_rng)
    return data, batches


def test_each_loader_has_its_own_name_and_one_iterated_as_it_is_passes_through() -> None:
    """A train loader read with batch() and an evaluation loader iterated as it is, inside rt.steps() and
    outside: rt.epochs is made at the first batch() only, and the evaluation moves nothing and refuses nothing."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop.of(rt, "rlaunch.test")
    assert UserLoop.of(rt, "rlaunch.other") is loop, "every prepare() of the script shares the runtime's loop"
    made: list[str] = []
    (train, _), (evaluation, _) = _data(rt, loop, made), _data(rt, loop, made)
    assert (train.name, evaluation.name) == ("data", "data1") and made == []
    assert sum(len(b[0]) for b in evaluation) == 4, "before the loop: read as it is (rank 0's 4 rows of 8)"
    seen = []
    for step in rt.steps(4):
        model(train.batch()[0][:, :2].float()).sum().backward()
        loop.vote(opt, None, opt.step)
        if step % 2 == 1:
            seen.append([b[0].tolist() for b in evaluation])  # after the step's vote, as a tutorial evaluates
    assert made == ["data"] and rt._s.tracked["data1"].state_dict() == {}, "the evaluation loader holds nothing"
    assert rt._s.refused == "" and seen[0] == seen[1] == [[[0.0, 1.0], [4.0, 5.0]], [[8.0, 9.0], [12.0, 13.0]]]


def test_a_loader_iterated_across_steps_refuses_moves() -> None:
    """next(iterator) on one iterator across steps of rt.steps(): a joiner's iterator is its own."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    data, _ = _data(rt, loop, [])
    it = iter(data)
    for _ in rt.steps(2):
        model(next(it)[0].float()).sum().backward()
        loop.vote(opt, None, opt.step)
    assert rt._s.refused.startswith("rlaunch.test: The prepared loader 'data' was read by iterating it")


def test_a_loader_iterated_whole_inside_a_step_before_its_vote_refuses_moves() -> None:
    """next(iter(loader)) in each step: every iteration begins another epoch of the loader (another
    order) that nothing carries, so a redone step or a joiner would read other batches."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    data, _ = _data(rt, loop, [])
    for _ in rt.steps(2):
        model(next(iter(data))[0].float()).sum().backward()
        loop.vote(opt, None, opt.step)
    assert rt._s.refused.startswith("rlaunch.test: The prepared loader 'data' was read by iterating it")
    assert rt._s.refused.endswith("after the step's optimizer step.")


def test_a_joiner_reads_its_new_ranks_part_of_a_loader_iterated_as_it_is() -> None:
    rt = _runtime()
    loop = UserLoop(rt, "rlaunch.test")
    data, batches = _data(rt, loop, [])
    rt._s.rank = 1  # as a standby's, once it took rank 1
    loop.joined()
    assert batches.sampler.rank == 1 and [b[0].tolist() for b in data][0] == [[2.0, 3.0], [6.0, 7.0]]


def test_a_loader_first_read_inside_a_step_is_put_back_when_the_step_is_redone() -> None:
    """rt.epochs is made at the first batch(), inside step 0: the step's start holds its first position,
    so a redone step 0 reads the same batch again, not the next one."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    data, _ = _data(rt, loop, [])
    read = []
    for step in rt.steps(2):
        read.append(data.batch()[0].tolist())
        if step == 0 and len(read) == 1:
            rt._s.resume_at = 0  # the step is discarded (a fault): rt.steps() yields it again
            continue
        model(torch.tensor(read[-1])).sum().backward()
        loop.vote(opt, None, opt.step)
    assert read[0] == read[1] != read[2], read


def test_a_loader_first_read_late_is_known_from_the_start_and_made_where_a_read_position_lands() -> None:
    """A second train loader for a later phase: its position is tracked from prepare() as {} (a joiner's
    sandbox never read it, a host snapshot may predate its first read), a position that lands makes
    rt.epochs there, alone, and a position put back before the first read makes it again at the next."""
    rt = _runtime()
    model, opt = _model()
    rt.track(model=model, optimizer=opt)
    loop = UserLoop(rt, "rlaunch.test")
    made: list[str] = []
    order = torch.Generator().manual_seed(5)
    (first, _), (later, _) = _data(rt, loop, made), _data(rt, loop, made, order)
    before, order_before = rt._s.tracked["data1"].state_dict(), order.get_state()
    assert before == {} and made == [], "known before its first read"
    for _ in rt.steps(2):
        model(first.batch()[0]).sum().backward()
        loop.vote(opt, None, opt.step)
    read = [later.batch()[0].tolist()]
    sent = rt._s.tracked["data1"].state_dict()
    assert made == ["data", "data1"] and sent["epoch"] == 0 and sent["loader"], sent

    joiner_rt = _runtime()
    joiner_loop = UserLoop(joiner_rt, "rlaunch.test")
    joiner_made: list[str] = []
    _data(joiner_rt, joiner_loop, joiner_made)
    joiner_later, _ = _data(joiner_rt, joiner_loop, joiner_made)
    joiner_rt._s.tracked["data1"].load_state_dict(sent)  # a joiner whose sandbox never read it
    assert joiner_made == ["data1 alone"], "made where the position landed, with no rank to sync with"
    assert joiner_later.batch()[0].tolist() == later.batch()[0].tolist() != read[0], "the same next batch"

    rt._s.tracked["data1"].load_state_dict(before)  # back to a snapshot before its first read
    assert torch.equal(order.get_state(), order_before), "its order's generator as it was before the first read"
    assert later.batch()[0].tolist() == read[0] and made == ["data", "data1", "data1"], "made again, read again"


def test_back_before_a_loaders_first_batch_its_datasets_generator_is_as_that_batch_found_it() -> None:
    """A snapshot from before the first batch() makes the loader again from its start, and the generator
    its dataset holds goes back with it, so the redone first batch gets the same transforms."""
    rt = _runtime()
    loop = UserLoop(rt, "rlaunch.test")
    loader = StatefulDataLoader(Noisy(), batch_size=4)
    data = loop.data(lambda name, together: rt.epochs(loader, name=name, track=False), loader, lambda b: b, 12, "")
    before = rt._s.tracked["data"].state_dict()
    first = data.batch()
    rt._s.tracked["data"].load_state_dict(before)
    assert torch.equal(data.batch(), first)


class Noisy(Dataset[torch.Tensor]):
    """Samples with a transform drawn from a generator the dataset holds."""

    def __init__(self) -> None:
        self.noise = torch.Generator().manual_seed(7)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1, generator=self.noise)
