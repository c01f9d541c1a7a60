"""SFT data end to end: datasets on disk (JSONL, Parquet, shards, globs), bad rows, the
held-out split, shuffling and epochs, the data-parallel partition, packing invariance of
conversations. (The SFT job submitted with `ray job submit`, as `make demo` runs it, is in
test_rl.py: the demo's first stage.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config import DataConfig
from miles.data.dataset import BadRow, DataError, dataset_files, iter_rows
from miles.data.sample import Sample
from miles.data.sft import SFTSource
from miles.train.batching import packed_replica_micro_batches, partition, positions, split_rows

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "miles" / "data" / "bundled" / "chat_tiny"


def chat(q: str, a: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], **extra}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def source(path, reports: list | None = None, run_dir=None, **data) -> SFTSource:
    cfg = DataConfig(source="chat", path=str(path), tokenizer="tiny", shuffle_buffer=0, **data)
    return SFTSource(cfg, seed=1, run_dir=run_dir,
                     report=(reports.append if reports is not None else lambda _: None))


# Each bad kind with its line number in the file written below (line 3 is blank: skipped, not bad).
BAD_LINES = {
    2: ('{"messages": [{"role": "user"', "malformed JSON"),
    4: ({"text": "hello"}, "no 'messages' column (nor 'prompt' and 'response')"),
    5: ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
        "message 1: unknown role 'robot'"),
    6: ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        "message 1: empty assistant turn"),
    7: (chat("Tell me everything.", "word " * 200), "longer than data.seq_len=64 positions"),
    8: ([1, 2, 3], "expected a JSON object, got list"),
    9: ({"prompt": "hi"}, "'response' must be a non-empty string"),
    10: (chat("hi", "yo", thinking="yes"), "'thinking' must be true or false"),
    11: ({"messages": "hello"}, "'messages' must be a non-empty list"),
}
GOOD_LINES = {1: chat("What is 1 + 1?", "2."),
              12: {"prompt": "What is 2 + 2?", "response": "4.", "system": "Be brief."}}


@pytest.fixture
def mixed_file(tmp_path) -> Path:
    lines = [""] * 12
    for n, row in GOOD_LINES.items():
        lines[n - 1] = json.dumps(row)
    for n, (row, _) in BAD_LINES.items():
        lines[n - 1] = row if isinstance(row, str) else json.dumps(row)
    return write_jsonl(tmp_path / "mixed.jsonl", lines)


def test_bad_rows_are_reported_with_file_row_and_reason_then_skipped_and_counted(mixed_file, tmp_path):
    """Each kind of bad row gives its documented reason with `file:line`, is written to
    skipped_rows.jsonl and counted once (not again in the next epoch); the good rows train."""
    reports: list[str] = []
    src = source(mixed_file, reports, run_dir=tmp_path, seq_len=64)
    got = src.batch(1, 4)  # two epochs of the two good rows
    assert len(got) == 4 and got[0].tokens == got[2].tokens and got[1].tokens == got[3].tokens
    assert src.metrics() == {"data/skipped_rows": float(len(BAD_LINES)), "data/epoch": 1.0}
    assert len(reports) == len(BAD_LINES)
    for report, (n, (_, reason)) in zip(reports, sorted(BAD_LINES.items()), strict=True):
        assert report.startswith(f"skipped row {mixed_file}:{n}: ") and reason in report, report
    src.close()
    logged = [json.loads(x) for x in (tmp_path / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(r["file"], r["row"]) for r in logged] == [(str(mixed_file), n) for n in sorted(BAD_LINES)]


def test_on_bad_row_error_fails_at_the_first_bad_row(mixed_file):
    with pytest.raises(BadRow, match=f"{mixed_file}:2: malformed JSON"):
        source(mixed_file, seq_len=64, on_bad_row="error").batch(1, 2)


def test_prompt_response_rows_are_one_trained_turn(tmp_path):
    """prompt/response (and system) columns are the conversation system, user, assistant."""
    a = source(write_jsonl(tmp_path / "a.jsonl", [GOOD_LINES[12]])).batch(1, 1)[0]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."}]
    b = source(write_jsonl(tmp_path / "b.jsonl", [{"messages": msgs}])).batch(1, 1)[0]
    assert a == b and 0 < sum(a.loss_mask) < len(a.tokens)


def test_broken_parquet_files_are_data_errors_naming_the_file(tmp_path):
    """Guards a pyarrow exception from deep inside the reader: a file that is not Parquet and
    one whose data pages are damaged past a readable footer are DataErrors (the CLI's clean
    exit 1) naming the file; rows before the damage were read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "not.parquet").write_text("plain text")
    with pytest.raises(DataError, match="not.parquet: not a readable Parquet file"):
        list(iter_rows(tmp_path / "not.parquet"))
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 20}]} for i in range(400)]
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="snappy")
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(0)  # the third row group's pages: garbage
    start = col.dictionary_page_offset or col.data_page_offset
    data[start:start + col.total_compressed_size] = bytes(col.total_compressed_size)
    path.write_bytes(bytes(data))
    got = []
    with pytest.raises(DataError, match=r"damaged.parquet: Parquet data unreadable after row 200"):
        for row in iter_rows(path, batch_rows=100):
            got.append(row)
    assert len(got) == 200 and got[-1].record["messages"][0]["content"].startswith("question 199")


def test_parquet_shards_directories_and_globs_read_like_jsonl(tmp_path):
    """A Parquet shard (messages as a list of structs, tool calls, loss: false) gives the same
    samples as the same rows in JSONL; a bad Parquet row is reported with its row number; a
    directory reads its shards in name order and a glob its matches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(x) for x in (BUNDLED / "eval.jsonl").read_text().splitlines()[:6]]
    rows = [r for r in rows if "tools" not in r]  # tools as JSON text below
    tool_row = [json.loads(x) for x in (BUNDLED / "train.jsonl").read_text().splitlines() if '"tools"' in x][0]
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", rows)
    table = pa.Table.from_pylist([{"messages": r["messages"], "thinking": r.get("thinking", False), "tools": None}
                                  for r in rows[:2]] + [{"messages": bad["messages"], "thinking": False, "tools": None}]
                                 + [{"messages": tool_row["messages"], "thinking": tool_row.get("thinking", False),
                                     "tools": json.dumps(tool_row["tools"])}])
    pq.write_table(table, shards / "b.parquet", row_group_size=2)
    assert [p.name for p in dataset_files(shards)] == ["a.jsonl", "b.parquet"]
    assert [p.name for p in dataset_files(str(shards / "*.parquet"))] == ["b.parquet"]
    reports: list[str] = []
    src = source(shards, reports, seq_len=1024)
    got = src.batch(1, len(rows) + 3)
    want = source(write_jsonl(tmp_path / "same.jsonl", rows + rows[:2] + [tool_row]), seq_len=1024).batch(
        1, len(rows) + 3)
    assert got == want
    assert reports == [f"skipped row {shards / 'b.parquet'}:3: message 1: unknown role 'wizard' (system, user, "
                       "assistant, tool)"]
    for spec, err in ((tmp_path / "none.jsonl", "no such file"), (str(tmp_path / "*.csv"), "matches no files"),
                      (tmp_path, "not .jsonl or .parquet")):
        (tmp_path / "x.txt").write_text("")
        with pytest.raises((FileNotFoundError, ValueError), match=err):
            dataset_files(spec if spec != tmp_path else str(tmp_path / "*"))


def test_rows_stream_one_at_a_time(tmp_path):
    """The reader is a generator over the file: the first row arrives while the rest of a
    file is still unreadable (a malformed tail does not fail what came before)."""
    path = write_jsonl(tmp_path / "d.jsonl", [chat("a", "b")] * 3 + ["{broken"])
    rows = iter_rows(path)
    first = next(rows)
    assert first.row == 1 and first.error is None
    assert [r.row for r in rows] == [2, 3, 4]


def test_held_out_split_is_never_trained_and_shuffling_is_seeded(tmp_path):
    """Without eval_path the first eval_size usable rows are held out and training never
    yields them; each epoch is a seeded permutation of the rest (same seed, same order;
    epochs differ)."""
    rows = [chat(f"What is {i} + {i}?", f"{2 * i}.") for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(source="chat", path=str(path), tokenizer="tiny", eval_size=5, shuffle_buffer=8)
    src = SFTSource(cfg, seed=3)
    held = {tuple(s.tokens) for s in src.eval_samples()}
    epoch0, epoch1 = src.batch(1, 35), src.batch(2, 35)
    alone = {tuple(s.tokens) for s in source(path, seq_len=64).batch(1, 40)}
    assert len(held) == 5 and held | {tuple(s.tokens) for s in epoch0} == alone, "a permutation of the rest"
    assert not held & {tuple(s.tokens) for s in epoch0 + epoch1}
    assert [s.tokens for s in epoch0] != [s.tokens for s in epoch1], "each epoch its own order"
    again = SFTSource(cfg, seed=3).batch(1, 35)
    assert again == epoch0
    assert SFTSource(cfg, seed=4).batch(1, 35) != epoch0


def test_a_dataset_without_usable_rows_fails_clearly(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="no usable training rows .1 skipped"):
        source(path).batch(1, 1)


# --------------------------------------------------------------------------- the data-parallel partition
def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample(list(range(n + 1)), [0] + [1] * n) for n in lengths]


def test_partition_balances_tokens_with_equal_counts():
    """Each replica gets n // dp samples (or one more) and the positions spread within the
    longest sample; contiguous shares of a sorted batch would put every long one on rank 0."""
    lengths = [900, 850, 700, 40, 30, 30, 20, 10]
    parts = partition(_samples(lengths), 2)
    assert [len(p) for p in parts] == [4, 4]
    loads = [sum(positions(s) for s in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths), loads
    assert sorted(positions(s) for p in parts for s in p) == sorted(lengths)
    assert [len(p) for p in partition(_samples([5] * 7), 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="2 samples cannot be shared by 4"):
        partition(_samples([3, 3]), 4)


def test_expert_parallel_replicas_get_the_same_number_of_micro_batches():
    """With same_count every replica runs as many micro-batches as the one with the most
    (packed rows are split), and no sample is lost or duplicated."""
    samples = _samples([60, 60, 60, 60, 10, 10, 10, 10])
    plain = packed_replica_micro_batches(samples, 2, 1, row_tokens=64)
    even = packed_replica_micro_batches(samples, 2, 1, row_tokens=64, same_count=True)
    assert len({len(r) for r in even}) == 1
    assert sum(float(mb.loss_mask.sum()) for r in even for mb in r) == sum(positions(s) for s in samples)
    assert sum(float(mb.loss_mask.sum()) for r in plain for mb in r) == sum(positions(s) for s in samples)
    rows = split_rows([[samples[4], samples[5], samples[6]]], 3)
    assert [len(r) for r in rows] == [1, 1, 1]


# --------------------------------------------------------------------------- packing invariance
def test_packed_conversations_have_the_per_token_losses_and_gradients_of_each_alone(seed):
    """Guards cross-talk between packed conversations (attention, compression blocks, the
    indexer and MTP crossing a document boundary): per-token log-probabilities of chat
    samples (multi-turn, thinking, tools) packed into rows equal those of each conversation
    run alone, and so do the gradients of the summed loss (LM, MTP, indexer). fp32 on CPU:
    the same ops on the same rows up to reduction order, so 1e-5."""
    from conftest import NEAR_TIE, assert_close, choice_margin

    from miles.train import losses
    from miles.train.batching import pack, to_micro_batch
    from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

    g = torch.Generator().manual_seed(seed)
    lines = (BUNDLED / "eval.jsonl").read_text().splitlines()
    rows = [lines[i] for i in torch.randperm(len(lines), generator=g).tolist()]
    kinds = {}
    for line in rows:
        r = json.loads(line)
        kinds.setdefault("tools" if "tools" in r else "thinking" if r.get("thinking") else "chat", []).append(r)
    chosen = kinds["chat"][:3] + kinds["thinking"][:2] + kinds.get("tools", [])[:1]
    path = write_jsonl(Path(__import__("tempfile").mkdtemp()) / "c.jsonl", chosen)
    samples = source(path, seq_len=1024, reasoning_effort="low").batch(1, len(chosen))
    rows_ = pack(samples, max_tokens=1024)
    assert any(len(r) > 1 for r in rows_), "something is packed"
    packed = to_micro_batch(rows_)
    for i in range(20):  # a model whose routers and indexers meet no near tie on these rows (~1 in 500 did)
        model = DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(vocab_size=512), seed=seed + 1000 * i)
        if choice_margin(model, packed.input_ids, doc_ids=packed.doc_ids) > NEAR_TIE:
            break
    ones = {k: torch.tensor(1.0) for k in ("lm", "mtp", "indexer", "balance")}

    def run(mb):
        model.zero_grad(set_to_none=True)
        out, res = losses.compute(model, mb, norm=ones)
        res.loss.backward()
        lp = losses.label_logprobs(model.ctx, out.logits, mb).detach()
        return lp, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    packed_lp, packed_grads = run(packed)
    alone_grads: dict[str, torch.Tensor] = {}
    for b, row in enumerate(rows_):
        at = 0
        for s in row:
            lp, grads = run(to_micro_batch([[s]]))
            n = positions(s)
            assert_close(packed_lp[b, at:at + n], lp[0, :n], atol=1e-5, rtol=1e-5, what="per-token log p")
            at += n
            for k, v in grads.items():
                alone_grads[k] = alone_grads.get(k, 0) + v
    assert alone_grads.keys() == packed_grads.keys()
    for k in packed_grads:
        assert_close(packed_grads[k], alone_grads[k], atol=1e-5, rtol=1e-4, what=k)


def test_the_v4_flash_sft_job_validates_against_v4_flash(tmp_path):
    """jobs/sft_dsv4_flash.yaml (documented, not run here) is a valid job for V4-Flash's
    config.json on 64 ranks: its layout divides the model (heads, experts, layers, vocab)."""
    from test_config import FLASH, write_config

    from miles.config import load_job

    write_config(tmp_path / "flash", FLASH)
    data = ROOT / "miles" / "data" / "bundled" / "chat_tiny"
    job = load_job(ROOT / "jobs" / "sft_dsv4_flash.yaml", [f"model.config={tmp_path / 'flash'}",
                                                            f"ckpt.hf={tmp_path / 'flash'}",
                                                            f"data.path={data / 'train.jsonl'}",
                                                            f"data.eval_path={data / 'eval.jsonl'}"])
    assert job.train.parallel.world == 64 and job.model.arch.num_hidden_layers == 43
    assert job.ckpt.load == "auto" and job.ckpt.async_save and job.ckpt.keep_last == 2
    assert job.data.source == "chat" and job.data.tokenizer is None


def test_bundled_chat_data_and_tokenizer_are_what_the_script_makes():
    """miles/data/bundled/ is reproducible: scripts/make_tiny_chat.py --check regenerates the
    conversations and retrains the tokenizer and finds the committed files identical."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_chat.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("n,k", [(3, 5), (5, 4)])  # resume mid-epoch (15 of 20 drawn); at an epoch boundary
def test_resumed_data_neither_repeats_nor_skips_a_sample(tmp_path, n, k):
    """The data position in a checkpoint (SFTSource.state, through JSON) continues exactly: the
    sample ids (file:row) a resumed source yields after step k are those of the uninterrupted
    run; at an epoch boundary the resumed run trains the next epoch's data; and each epoch
    holds every usable row once (bad rows stay counted once)."""
    rows = [chat(f"What is {i} + {i}?", f"{2 * i}.") for i in range(20)]
    rows[7] = {"text": "a bad row"}
    rows.append(chat("last", "one."))
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(source="chat", path=str(path), tokenizer="tiny", shuffle_buffer=6)
    straight = SFTSource(cfg, seed=2, report=lambda _: None)
    ids = [[s.origin for s in straight.batch(step, n)] for step in range(1, 13)]
    first = SFTSource(cfg, seed=2, report=lambda _: None)
    for step in range(1, k + 1):
        assert [s.origin for s in first.batch(step, n)] == ids[step - 1]
    state = json.loads(json.dumps(first.state()))
    resumed = SFTSource(cfg, seed=2, report=lambda _: None)
    resumed.load_state(state)
    after = [[s.origin for s in resumed.batch(step, n)] for step in range(k + 1, 13)]
    print(f"n={n} k={k}: step {k + 1} after resuming trains {after[0]}")
    assert after == ids[k:], "the resumed source must continue the straight run's sample order"
    flat = [x for b in ids for x in b]
    assert sorted(flat[:20]) == sorted(f"d.jsonl:{r}" for r in range(1, 22) if r != 8), "an epoch: every row once"
    if n * k == 20:
        assert (state["epoch"], state["consumed"]) == (0, 20)
        assert set(after[0]) <= set(flat[20:40]), "after an epoch boundary: the next epoch's samples"
    assert resumed.metrics()["data/skipped_rows"] == straight.metrics()["data/skipped_rows"] == 1
    with pytest.raises(DataError, match="seed 2.*train.seed 3"):
        SFTSource(cfg, seed=3, report=lambda _: None).load_state(state)


def test_the_jobs_tokenizer_goes_beside_the_weights(tmp_path):
    """ckpt.save_hf and miles convert put the run's tokenizer in the HF directory as
    tokenizer.json (the bundled tiny one, a file, DeepSeek-V4's by default; a transformers
    directory's tokenizer files), so miles serve answers text from the directory alone."""
    from miles.data.chat import v4_tokenizer_file
    from miles.data.sft import copy_tokenizer, tokenizer_path

    for name, want in (("tiny", Path(tokenizer_path("tiny"))), (None, v4_tokenizer_file())):
        out = tmp_path / str(name)
        out.mkdir()
        assert copy_tokenizer(name, "deepseek_v4", out) == out / "tokenizer.json"
        assert (out / "tokenizer.json").read_bytes() == want.read_bytes()
    hf_tok = tmp_path / "hf-tokenizer"
    hf_tok.mkdir()
    (hf_tok / "tokenizer.json").write_text("{}")
    (hf_tok / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    out = tmp_path / "hf-out"
    out.mkdir()
    assert copy_tokenizer(str(hf_tok), "hf", out) == out / "tokenizer.json"
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
