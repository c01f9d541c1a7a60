"""Checkpoint numbering, retention and the directory protocol (miles.ckpt.policy, store)."""

from __future__ import annotations

import json

import pytest

from miles.ckpt import policy, store
from miles.ckpt.store import CheckpointError


def _run(steps: int, save_interval: int, keep_every, keep_last, warmup: bool = True, first: int = 1,
         existing: set[int] = frozenset(), async_save: bool = False, marked: set[int] | None = None) -> set[int]:
    """What remains after a run of steps first..steps that saves and reaps as the manager does
    (`marked` collects the warm-up saves, as their metadata records them)."""
    have, marked = set(existing), marked if marked is not None else set()
    for step in range(first, steps + 1):
        rule = (step, steps, save_interval, warmup, first, async_save)
        if policy.saves_at(*rule):
            have.add(step)
            if policy.is_warmup(*rule):
                marked.add(step)
            have -= set(policy.to_delete(have, save_interval, keep_every, keep_last, marked))
    return have


def test_iterations_are_completed_steps_counted_from_one():
    assert policy.iter_name(50) == "iter_0000050"
    assert policy.parse_iter_name("iter_0000050") == 50
    assert policy.parse_iter_name("iter_50") is None and policy.parse_iter_name(".tmp-iter_0000050") is None
    saved = [s for s in range(1, 251) if policy.saves_at(s, 250, 50, True)]
    assert saved == [1, 50, 100, 150, 200, 250]


def test_the_issue_example_keeps_exactly_100_200_250():
    """save_interval 50, keep_every 100, keep_last 2, warm-up save on, 250 steps: the warm-up
    iter 1 is reaped; 100 and 200 are multiples; 200 and 250 the newest two."""
    assert _run(250, 50, 100, 2) == {100, 200, 250}


@pytest.mark.parametrize("steps,interval,every,last,want", [
    (250, 50, None, 2, {200, 250}),  # keep_every unset: only the last N
    (250, 50, None, 1, {250}),
    (250, 50, None, None, {50, 100, 150, 200, 250}),  # keep all; the warm-up save still goes
    (237, 50, 100, 2, {100, 200, 237}),  # a last step off the interval is saved
    (10, 0, None, None, {10}),  # no interval: the warm-up and the last step; the warm-up reaped
    (1, 50, None, 2, {1}),  # the warm-up save is the newest: never deleted
    (5, 1, None, 2, {4, 5}),  # interval 1: iteration 1 is an ordinary save
    (5, 1, 1, 2, {1, 2, 3, 4, 5}),
])
def test_retention_enumerated(steps, interval, every, last, want):
    assert _run(steps, interval, every, last) == want


def test_no_warmup_save_when_off_or_when_resuming_with_synchronous_saves():
    assert not policy.saves_at(1, 100, 50, False)
    assert not policy.saves_at(51, 100, 50, True, first_step=51)  # resumed, synchronous: the path was proven
    assert policy.retained([1], 50, None, 2) == {1}


def test_every_process_that_saves_asynchronously_makes_a_warmup_save():
    """The async writer's state is made at a process's first save: a resumed process that saves
    asynchronously saves right after its first step too, and that save is reaped like the
    first run's, even where keep_last keeps everything."""
    assert policy.saves_at(51, 100, 50, True, first_step=51, async_save=True)
    assert policy.is_warmup(51, 100, 50, True, first_step=51, async_save=True)
    assert not policy.saves_at(51, 100, 50, False, first_step=51, async_save=True)
    assert not policy.is_warmup(100, 100, 50, True, first_step=100, async_save=True)  # the last step's save anyway
    marked: set[int] = set()
    first = _run(120, 50, None, None, async_save=True, marked=marked)
    assert first == {50, 100, 120} and marked == {1}
    assert _run(250, 50, None, None, first=121, existing=first, async_save=True, marked=marked) == \
        {50, 100, 120, 150, 200, 250}
    assert 121 in marked, "the resumed process made no warm-up save"


def test_a_resumed_run_applies_the_same_policy_to_what_it_finds():
    """Run 1 stops at 120 (saves 1, 50, 100, 120 -> keeps 100, 120 with keep_last 2); run 2
    resumes from 120 to 250: iter 120 goes when newer ones come; the multiples stay."""
    first = _run(120, 50, 100, 2)
    assert first == {100, 120}
    assert _run(250, 50, 100, 2, first=121, existing=first) == {100, 200, 250}


def test_the_newest_is_never_deleted():
    for its in ([3], [1, 7], [5, 6, 7, 9]):
        assert max(its) in policy.retained(its, 2, None, 1)
        assert max(its) in policy.retained(its, 2, 4, None)


def _fake(save_dir, it: int, warmup: bool = False) -> None:
    tmp = store.begin(save_dir, it)
    (tmp / "data.bin").write_bytes(b"x" * it)
    store.commit(save_dir, it, {"data": {}, "model": {"hidden_size": 8}, "warmup": warmup})


def test_reap_finds_the_warmup_saves_in_their_metadata(tmp_path):
    """A resumed process's warm-up save (iteration 51 here) is known by its metadata: the next
    reap deletes it once a newer checkpoint exists; an ordinary off-interval save stays."""
    for it, warm in ((50, False), (51, True), (73, False), (100, False)):
        _fake(tmp_path, it, warm)
    said = []
    assert store.reap(tmp_path, 50, None, None, said.append) == [51]
    assert store.iterations(tmp_path) == [50, 73, 100] and "iter_0000051" in said[0]


def test_commit_rename_and_tracker(tmp_path):
    _fake(tmp_path, 5)
    assert (tmp_path / "iter_0000005" / "data.bin").read_bytes() == b"xxxxx"
    assert (tmp_path / store.TRACKER).read_text() == "5\n"
    assert store.iterations(tmp_path) == [5]
    assert store.resolve("auto", tmp_path) == tmp_path / "iter_0000005"
    assert store.resolve(str(tmp_path), tmp_path / "other") == tmp_path / "iter_0000005"
    assert store.resolve("auto", tmp_path / "none") is None


def test_leftovers_of_crashed_saves_are_removed_and_the_newest_complete_wins(tmp_path):
    """The three instants of a crash: before the rename (a .tmp dir), after it (iter dir, old
    tracker), a half-deleted reap; the next start removes the debris, repairs the tracker and
    resumes from the newest complete checkpoint."""
    _fake(tmp_path, 2)
    _fake(tmp_path, 4)
    store.begin(tmp_path, 6)  # crashed before the rename
    (tmp_path / "iter_0000008").mkdir()  # not a checkpoint: no metadata
    (tmp_path / store.TRACKER).write_text("2\n")  # crashed after the rename of 4, before the tracker
    (tmp_path / ".tmp-deleting-iter_0000001").mkdir()
    said = []
    store.recover(tmp_path, said.append)
    assert not list(tmp_path.glob(".tmp-*"))
    assert (tmp_path / store.TRACKER).read_text() == "4\n"
    assert store.resolve("auto", tmp_path) == tmp_path / "iter_0000004"
    assert any(".tmp-iter_0000006" in s for s in said) and any("tracker updated" in s for s in said)


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.resolve(str(tmp_path), tmp_path)
    (tmp_path / "iter_0000003").mkdir()
    with pytest.raises(CheckpointError, match=r"iter_0000003: not a complete checkpoint"):
        store.resolve(str(tmp_path / "iter_0000003"), tmp_path)
    (tmp_path / "iter_0000003" / store.META).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"iter_0000003/miles.json: corrupt"):
        store.read_meta(tmp_path / "iter_0000003")
    (tmp_path / "iter_0000003" / store.META).write_text(json.dumps({"format": 1, "iteration": 3,
                                                                    "model": {"hidden_size": 64, "n_layers": 2}}))
    meta = store.read_meta(tmp_path / "iter_0000003")
    with pytest.raises(CheckpointError, match=r"miles.json: model.hidden_size is 64 in the checkpoint but 128 in "
                                              r"the job"):
        store.check_model(meta, {"hidden_size": 128, "n_layers": 2}, tmp_path / "iter_0000003")
    store.check_model(meta, {"hidden_size": 64, "n_layers": 2, "kernels": "torch"}, tmp_path)  # switches aside


def test_a_job_refuses_a_checkpoint_of_another_model_before_anything_starts(tmp_path):
    """ckpt.load of a checkpoint saved for another architecture fails at the start naming the
    file, the field and both values; one already at train.steps says there is nothing left."""
    from miles.ckpt.manager import Checkpoints
    from miles.config import validate_job

    def job(**ckpt):
        return validate_job({"log": {"run_dir": str(tmp_path / "run")}, "train": {"steps": 10},
                             "ckpt": {"save_dir": str(tmp_path / "ck"), **ckpt}})

    arch = job().model.arch.to_dict()
    store.begin(tmp_path / "ck", 4)
    store.commit(tmp_path / "ck", 4, {"model": {**arch, "num_hidden_layers": arch["num_hidden_layers"] + 1}})
    with pytest.raises(CheckpointError, match=rf"iter_0000004/miles.json: model.num_hidden_layers is "
                                              rf"{arch['num_hidden_layers'] + 1} in the checkpoint but "
                                              rf"{arch['num_hidden_layers']} in the job"):
        Checkpoints(job(load="auto"), report=lambda _: None)
    store.begin(tmp_path / "ck", 12)
    store.commit(tmp_path / "ck", 12, {"model": arch})
    with pytest.raises(CheckpointError, match="already at iteration 12, and train.steps is 10"):
        Checkpoints(job(load="auto"), report=lambda _: None)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest iter_0000012\) that this run "
                                              r"would not continue from"):
        Checkpoints(job(), report=lambda _: None)  # a fresh start would reap another run's checkpoints
    store.remove(tmp_path / "ck" / "iter_0000012")
    store.remove(tmp_path / "ck" / "iter_0000004")
    assert Checkpoints(job(), report=lambda _: None).iteration == 0


def test_checkpoint_metadata_is_unpickled_only_through_an_allow_list(tmp_path):
    """torch reads dist_checkpointing's .metadata with plain pickle: a crafted one naming a
    callable is refused before that (file and global named); a truncated one is corrupt."""
    import os
    import pickle

    from miles.ckpt import safe_metadata

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused \(global 'posix.system' is not allowed\)"):
        safe_metadata.check(tmp_path)
    assert not (tmp_path / "owned").exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": 1})[:-3])
    with pytest.raises(CheckpointError, match=r"\.metadata: corrupt"):
        safe_metadata.check(tmp_path)
    with pytest.raises(CheckpointError, match="missing"):
        safe_metadata.check(tmp_path / "nothing")


def test_the_weights_a_run_started_from_are_recorded_and_found_on_resume(tmp_path):
    """Guards RL's KL reference on a resume (and on a start from converted weights): a fresh
    start records where its weights came from (DeepSeek's HF checkpoint, a converted
    weights-only checkpoint, or the seeded initialisation); a resume reads that record, not
    ckpt.hf (which a resumed job need not name) nor the checkpoint it resumes (trained weights)."""
    from miles.ckpt.manager import started_from

    hf, dist, mid = tmp_path / "hf", tmp_path / "dist" / "iter_0000000", tmp_path / "run" / "iter_0000010"
    assert started_from(None, hf, None) == {"hf": str(hf)}
    assert started_from(None, None, None) == {}
    assert started_from({"model_only": True, "iteration": 0}, None, dist) == {"dist": str(dist)}
    recorded = {"iteration": 10, "started_from": {"dist": str(dist)}}
    assert started_from(recorded, None, mid) == {"dist": str(dist)}
    assert started_from(recorded, hf, mid) == {"dist": str(dist)}, "the record wins over ckpt.hf"
    assert started_from({"iteration": 10}, hf, mid) == {"hf": str(hf)}, "an older checkpoint: ckpt.hf"
    assert started_from({"iteration": 10}, None, mid) == {}


def test_a_resumed_runs_kl_reference_never_changes_silently(tmp_path):
    """The recorded start is read while it exists; gone (moved, reaped), a CheckpointError
    naming the path and algo.kl_reference, whatever ckpt.hf says (it fell back to ckpt.hf, a
    reference the run never had). A reference the run named must be named again on a resume;
    one named for a run without one is allowed (it is explicit)."""
    from miles.ckpt.manager import reference_change, reference_weights

    there, gone, ref = tmp_path / "dist", tmp_path / "moved", tmp_path / "ref"
    there.mkdir()
    assert reference_weights({"dist": str(there)}, tmp_path) == {"dist": str(there)}
    assert reference_weights({}, tmp_path) == {}
    with pytest.raises(CheckpointError, match=r"started from .*moved .* gone: .* algo.kl_reference="):
        reference_weights({"dist": str(gone)}, tmp_path)
    named = {"job": {"algo": {"kl_reference": str(ref)}}}
    assert reference_change(None, None) == "" and reference_change({"job": {"algo": {}}}, ref) == ""
    assert reference_change(named, ref) == ""
    assert "this job names none" in reference_change(named, None)
    assert f"set algo.kl_reference={ref}" in reference_change(named, tmp_path / "other")


def test_a_resume_says_what_it_changes_and_an_rl_job_refuses_an_sft_runs_checkpoint(tmp_path):
    """Raising train.steps on a resume stretches the learning-rate schedule: one line says so
    with both values (the lr jumped from 2.0e-4 to 5.9e-4 unannounced). An RL job given an SFT
    run's checkpoint would count its SFT steps as rollouts: refused, pointing to ckpt.hf."""
    from miles.ckpt.manager import Checkpoints
    from miles.config import load_job

    ck = tmp_path / "ck"
    sft = load_job("jobs/sft_tiny.yaml", [f"log.run_dir={tmp_path / 'sft'}", f"ckpt.save_dir={ck}", "train.steps=10"])
    store.begin(ck, 4)
    store.commit(ck, 4, {"model": sft.model.arch.to_dict(), "job": sft.resolved()})
    said: list[str] = []
    Checkpoints(load_job("jobs/sft_tiny.yaml", [f"log.run_dir={tmp_path / 'sft'}", f"ckpt.save_dir={ck}",
                                                "ckpt.load=auto", "train.steps=10"]), report=said.append)
    assert not [x for x in said if "train.steps" in x]
    Checkpoints(load_job("jobs/sft_tiny.yaml", [f"log.run_dir={tmp_path / 'sft'}", f"ckpt.save_dir={ck}",
                                                "ckpt.load=auto", "train.steps=30"]), report=said.append)
    assert [x for x in said if "train.steps" in x] == [
        "checkpoint: train.steps 10 -> 30: the learning-rate schedule (warm-up, cosine decay) now spans 30 steps, "
        "so the lr of the next steps is not the saved run's"]
    arch = load_job("jobs/dapo_tiny.yaml", [f"log.run_dir={tmp_path / 'rl'}"]).model.arch
    store.begin(tmp_path / "ck2", 4)  # an SFT run of the RL job's model
    store.commit(tmp_path / "ck2", 4, {"model": arch.to_dict(), "job": sft.resolved()})
    rl = load_job("jobs/dapo_tiny.yaml", [f"log.run_dir={tmp_path / 'rl'}", f"ckpt.load={tmp_path / 'ck2'}",
                                          "train.steps=8"])
    with pytest.raises(CheckpointError, match=r"an SFT run's checkpoint \(iteration 4 of algo.loss: lm\); an RL job "
                                              r"resumes RL runs only: start from its weights with ckpt.hf="):
        Checkpoints(rl, report=lambda _: None)
