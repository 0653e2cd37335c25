"""
evaluate.py: pass^k on held-out tasks, tau-bench's way, for one or more models in one or more worlds (env.World):
the generated shop, tau2-bench's domains on tau2's own code, BFCL v3's multi-turn categories on bfcl-eval's code,
ACEBench's agent categories on our copy of its sandbox and checker.

    python evaluate.py                      # the demo's base, cold-start (SFT), MUA-RL (SFT+GRPO), RL-only rows
    python evaluate.py --models sft=out/sft grpo=out/grpo --k 4 --temperature 1.0   # sampled trials
    python evaluate.py --models sft=out/sft --domain retail airline telecom    # tau2's test split, on tau2's code
    python evaluate.py --models out/grpo --tasks ../shared/tau2/retail/tasks.json \
        --db ../shared/tau2/retail/db.json --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B \
        --max-new-tokens 1024 --max-len 16384
    python evaluate.py --bench bfcl --models sft=out/sft --categories base miss_func --n 20   # BFCL subset
    python evaluate.py --bench acebench --models sft=out/sft --user http://localhost:8001/v1 --user-model gpt-4o
    python evaluate.py --models sft=out/sft --tau1 retail airline --user http://localhost:8001/v1   # tau-bench v1

Every task is played k times per model. pass^k for a task with c successes out of n trials is C(c, k) / C(n, k)
(the chance that k trials drawn without replacement all succeed), averaged over tasks, with a 95% bootstrap
interval over tasks; pass^1 is the mean reward. results.json also holds pass@k (at least one success in k trials),
which under sampled trials (--temperature 1) bounds what RL can reach by sharpening the policy alone. The agent
decodes greedily by default (tau-bench's default), so trials differ through the user simulator: the scripted user
draws its wording from the trial's seed. Episodes whose user (or endpoint agent) failed are left out of n and
counted; the table also gives pass^k with them counted as 0, as `tau2 run --skip-failed-samples` does (the number
comparable to tau2's leaderboard; the two agree when nothing errored). Each episode is scored by its world on the
"task" basis, what the task checks (the database and the information the agent had to communicate, as tau-bench
scores); --db-only scores the database alone (grpo.py's --reward-basis db, the paper's training reward). Prints one
markdown table (per world, and per task kind where a world has several), with each world's own figures (telecom's
TCR, BFCL's mean over categories), and writes every transcript to JSONL. An http(s) URL in --models is an
OpenAI-compatible endpoint playing the agent.
"""
import argparse
import ast
import copy
import itertools
import json
import keyword
import math
import os
import re
import tempfile
from collections import defaultdict
from datetime import datetime, timedelta
from math import comb
from pathlib import Path

import torch

import env
from rollout import (TINY_BASE, ChatAgent, TextAgents, TokenAgent, add_user_args, all_errored, check_flags, cpu_threads,
                     errored_reasons, errored_summary, load_agent, require_vllm, run_episodes, short_reason,
                     user_backend)

def pass_hat_k(outcomes, k):
    """outcomes: {task_id: [0/1 rewards of its trials]} -> mean over tasks of C(c,k)/C(n,k); tasks with
    fewer than k trials are skipped. None if no task has k trials."""
    vals = [comb(int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    return sum(vals) / len(vals) if vals else None

def pass_at_k(outcomes, k):
    """The other pass@k: the chance that at least one of k trials drawn without replacement succeeds,
    1 - C(n-c, k) / C(n, k), averaged over tasks (Chen et al. 2021's unbiased estimator). Under sampled trials
    it bounds what RL that only sharpens the policy can reach; tau-bench's pass^k is the consistency metric."""
    vals = [1 - comb(len(rs) - int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    return sum(vals) / len(vals) if vals else None

def bootstrap(outcomes, k, n=1000, seed=0):
    """95% interval of pass^k over tasks: tasks resampled with replacement n times. -> [low, high] or None."""
    per = [comb(int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    if not per:
        return None
    rng = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(per), (n, len(per)), generator=rng)
    means = torch.tensor(per, dtype=torch.float64)[idx].mean(1).sort().values
    return [float(means[int(0.025 * n)]), float(means[min(n - 1, int(0.975 * n))])]

def evaluate(agent, world, tasks, *, k, seed, basis, batch):
    """Play k trials of every task, `batch` tasks at a time, and have the world score each episode. Trials differ
    through the sampling seed and the user's seed. -> episodes."""
    eps = []
    for trial in range(k):
        for i in range(0, len(tasks), batch):
            chunk = tasks[i:i + batch]
            played = run_episodes(agent, world, chunk, seed=seed + 1000 * trial + i)
            for ep, task in zip(played, chunk):
                if not ep.errored:  # a failed user or endpoint says nothing about the model: not scored
                    world.score(ep, task, basis)
            eps += played
    return eps

def summarize(eps, ks, world):
    """-> {"all": {...}, <task kind>: {...} where there are several, "figures": the world's own}: n (tasks with
    scored trials), the mean reward, pass^k with a 95% interval, pass@k, and the errored episodes and why."""
    by = defaultdict(lambda: defaultdict(list))
    by["all"] = defaultdict(list)  # present even when every episode errored
    as_zero = defaultdict(list)  # errored episodes counted as 0, as tau2 run --skip-failed-samples records them
    for e in eps:
        as_zero[e.task_id].append(0.0 if e.errored else e.reward)
        if not e.errored:
            by["all"][e.task_id].append(e.reward)
            by[e.kind or "-"][e.task_id].append(e.reward)
    if len({e.kind for e in eps}) < 2:
        by = {"all": by["all"]}
    out = {}
    for group, outcomes in by.items():
        trials = sum(len(r) for r in outcomes.values())
        out[group] = {"n": len(outcomes), "reward": sum(sum(r) for r in outcomes.values()) / trials if trials else None}
        for k in ks:
            out[group][f"pass^{k}"] = pass_hat_k(outcomes, k)
            out[group][f"pass^{k}_ci95"] = bootstrap(outcomes, k) if group == "all" else None
            out[group][f"pass@{k}"] = pass_at_k(outcomes, k)
    for k in ks:
        out["all"][f"pass^{k}_errored_0"] = pass_hat_k(as_zero, k)
    out["all"]["errored"] = sum(e.errored for e in eps)
    if out["all"]["errored"]:
        out["all"]["errored_reasons"] = dict(errored_reasons(eps))
    out["figures"] = world.summary(eps)
    return out

def markdown(results, ks):
    """results: {model: {world: summary}} -> one table: pass^k [95% interval] per world (and per task kind), and
    each world's own figures."""
    pct = lambda v: f"{100 * v:.1f}" if isinstance(v, (int, float)) and v is not None else "-"  # noqa: E731
    lines = ["| model | world | tasks | " + " | ".join(f"pass^{k} [95% CI]" for k in ks) + " | "
             + " | ".join(f"pass^{k}, errored = 0 (tau2's way)" for k in ks) + " | figures |",
             "|" + "---|" * (4 + 2 * len(ks))]
    for name, per in results.items():
        for world, s in per.items():
            for group in ["all"] + sorted(g for g in s if g not in ("all", "figures")):
                cells = [pct(s[group][f"pass^{k}"]) + (" [" + ", ".join(map(pct, s[group][f"pass^{k}_ci95"])) + "]"
                                                        if s[group][f"pass^{k}_ci95"] else "") for k in ks]
                label = world if group == "all" else f"{world} / {group}"
                figures = "; ".join(f"{k} {pct(v) if isinstance(v, float) else json.dumps(v)}"
                                    for k, v in s["figures"].items() if v is not None) if group == "all" else ""
                zero = [pct(s[group].get(f"pass^{k}_errored_0")) for k in ks]
                lines.append(f"| {name} | {label} | {s[group]['n']} | " + " | ".join(cells + zero) + f" | {figures} |")
    return "\n".join(lines)

def _fmt(v):
    return f"{v:.3f}" if v is not None else "-"

def parse_models(specs):
    """["sft=out/sft", "out/grpo"] -> {"sft": "out/sft", "grpo": "out/grpo"}"""
    out = {}
    for s in specs:
        name, _, path = s.rpartition("=")
        out[name or os.path.basename(os.path.normpath(path))] = path
    return out

def write_transcripts(path, eps):
    """One JSON line per episode, without its token ids."""
    with open(path, "w") as f:
        for ep in eps:
            f.write(json.dumps({k: v for k, v in ep.to_json().items() if k not in ("ids", "loss_mask", "logprobs")})
                    + "\n")

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--models", nargs="+",
                   default=[f"base={TINY_BASE}", "sft=out/sft", "mua-rl=out/grpo", "rl-only=out/grpo_rl_only"],
                   help="name=path: a run folder, checkpoint, hub id or OpenAI-compatible URL (default: the demo's; "
                        "its base is the committed tests/tiny_base)")
    g.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the agent's sampler (checkpoints)")
    g.add_argument("--vllm-gpu-memory", type=float, default=0.5, help="vLLM's share of the GPU (weights + KV cache)")
    g.add_argument("--agent-model", default=None, help="model name at an endpoint in --models (default: its name)")
    g.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="Qwen3-style templates: enable_thinking on or off (default: the template's)")
    g = p.add_argument_group("worlds (default: the generated shop's test split)")
    g.add_argument("--data-dir", default="data", help="synth.py's folder: shop.json and test_tasks.jsonl")
    g.add_argument("--tasks", dest="tasks_file", default=None,
                   help="any tau2 tasks.json / our JSONL (default: the generated test split)")
    g.add_argument("--db", dest="db_file", default=None,
                   help="the db.json the --tasks run on (default: <data-dir>/shop.json)")
    g.add_argument("--n-tasks", type=int, default=None, help="only the first n tasks (of each world)")
    g.add_argument("--policy-file", default=None, help="the agent's domain policy (default: policy.md beside --tasks, "
                   "if there; 'none': the generated shop's short prompt)")
    g.add_argument("--domain", nargs="+", default=None, choices=env.TAU2_DOMAINS,
                   help="tau2-bench domains, run and scored by tau2's own code (needs requirements-tau2.txt); a "
                        "--tasks file inside a tau2 domain folder picks its domain the same way")
    g.add_argument("--tau1", nargs="+", default=None, choices=env.TAU1_DOMAINS,
                   help="tau-bench v1 domains (TAU1) from ../shared/tau1 (or MUA_TAU1_DIR), on v1's semantics")
    g.add_argument("--split", default="test", help="with --domain: tau2's task split (train, test, base; telecom "
                   "also small, full), also of a --tasks file with a split_tasks.json beside it (tau2 v1.0.x); "
                   "with --tau1: test, train or dev (retail)")
    g.add_argument("--judge", default=None, help="with --domain: OpenAI-compatible URL of the LLM that judges "
                                                  "tau2's NL assertions (default: reported as not judged)")
    g.add_argument("--judge-model", default=None, help="model name at the --judge endpoint")
    g.add_argument("--bench", default="tau2", choices=["tau2", "bfcl", "acebench"],
                   help="tau2: the shop or tau2's domains; bfcl: BFCL v3's multi-turn categories; acebench: "
                        "ACEBench's agent multi_turn (needs an LLM --user) and multi_step")
    g.add_argument("--categories", nargs="+", default=None, help="with --bench bfcl: with or without 'multi_turn_' "
                   "(default: all four); acebench: multi_turn, multi_step (default: both)")
    g.add_argument("--n", type=int, default=None, help="with --bench bfcl or acebench: the first n entries of each "
                                                        "category")
    g.add_argument("--acebench-dir", default=None, help="chenchen0103/ACEBench's data, found by file name (default: "
                                                         "$MUA_ACEBENCH_DIR, else ../shared/acebench)")
    g = p.add_argument_group("rollout")
    g.add_argument("--k", type=int, default=4, help="trials per task (BFCL plays each entry once)")
    # the agent decodes greedily, as tau-bench's run.py does by default (--temperature 0.0): pass^k then measures
    # consistency over the user's variations (the scripted user words each trial differently), not sampling luck
    g.add_argument("--temperature", type=float, default=0.0, help="the agent's sampling temperature (0: greedy)")
    g.add_argument("--db-only", action="store_true", help="score the database alone (grpo.py --reward-basis db)")
    g.add_argument("--max-turns", type=int, default=None,
                   help="agent turns per episode (default 16; BFCL: 21 per user turn, past BFCL's limit; a tau2 "
                        "domain: none, tau2's own 200 steps and 10 errors end it, and a value here only lowers that)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per agent turn (the tiny model's longest ~40)")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per episode (tiny: an oracle one is <600)")
    g.add_argument("--batch", type=int, default=64, help="episodes played together (one run_episodes call)")
    g.add_argument("--seed", type=int, default=1234, help="trial t plays with seed + 1000 t")
    add_user_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results.json, results.md, a transcript JSONL per model and world "
                                                "(default: out/eval)")
    a = p.parse_args(argv)
    cpu_threads()  # the same numbers on any CPU (rollout.cpu_threads)
    check_flags(p, a, [  # checked up front: one line naming the flag and what it may be
            ("--k", a.k >= 1, ">= 1"), ("--temperature", a.temperature >= 0, ">= 0 (0: greedy)"),
            ("--n-tasks", a.n_tasks is None or a.n_tasks >= 1, ">= 1"),
            ("--max-turns", a.max_turns is None or a.max_turns >= 1, ">= 1"),
            ("--max-new-tokens", a.max_new_tokens >= 1, ">= 1"), ("--max-len", a.max_len >= 2, ">= 2"),
            ("--batch", a.batch >= 1, ">= 1"), ("--llm-concurrency", a.llm_concurrency >= 1, ">= 1"),
            ("--llm-deadline", a.llm_deadline > 0, "> 0")])
    if a.judge and not a.judge_model:
        p.error("--judge needs --judge-model")
    if a.tau1 and (a.domain or a.tasks_file or a.bench != "tau2"):
        p.error("--tau1 plays v1's own tasks: not with --domain, --tasks or --bench bfcl")
    if a.backend == "vllm":
        require_vllm()
    return run(a)

def named_worlds(a):
    """The worlds the flags name, each with its tasks: {name: (world, tasks)}."""
    users = user_backend(a.user, a.user_model, concurrency=a.llm_concurrency, deadline=a.llm_deadline)
    guidelines = env.load_guidelines(a.user_guidelines) if a.user_guidelines else None
    if a.bench == "bfcl":
        w = BFCL(a.categories, a.n, max_turns=a.max_turns)
        return {w.name: (w, w.tasks)}
    if a.bench == "acebench":
        bad = set(a.categories or []) - set(ACE_CATEGORIES)
        if bad:
            raise SystemExit(f"unknown ACEBench category {sorted(bad)[0]!r}; valid: {', '.join(ACE_CATEGORIES)}")
        ws = [ACEBench(c, a.acebench_dir, a.n, user=users) for c in a.categories or ACE_CATEGORIES]
        return {w.name: (w, w.tasks) for w in ws}
    if a.tau1:
        worlds = [env.Tau1(d, user=users, guidelines=guidelines, max_turns=a.max_turns or 30) for d in a.tau1]
        return {w.name: (w, w.tasks(a.split)[:a.n_tasks]) for w in worlds}
    # airline and telecom tasks run on tau2's code (only there); retail's run there when they are the installed
    # tau2's own, else on env.py's tools, which follow the newer tau2 (../shared: get_item_details) and need no tau2
    domain = env.tau2_domain_of(a.tasks_file)
    own = domain == "retail" and env.has_tau2() and env.is_installed_tau2_data(a.tasks_file)
    if a.domain or domain and (domain != "retail" or own):
        out = {}
        for name in a.domain or [domain]:  # a --tasks file replaces the split (and --db the database) of its domain
            w = env.Tau2(name, db=a.db_file if a.tasks_file else None, user=users, guidelines=guidelines,
                         judge=(a.judge, a.judge_model) if a.judge else None, max_turns=a.max_turns)
            out[name] = (w, w.tasks(a.split, path=a.tasks_file)[:a.n_tasks])
            if not out[name][1]:
                raise SystemExit(f"evaluate.py: no {name} tasks in split {a.split!r}")
        return out
    tasks_path = a.tasks_file or os.path.join(a.data_dir, "test_tasks.jsonl")
    beside = env.guidelines_beside(a.tasks_file)
    w = env.Shop(env.load_db(a.db_file or os.path.join(a.data_dir, "shop.json")), name=domain, user=users,
                 policy=env.policy_text(a.policy_file, a.tasks_file), max_turns=a.max_turns or 16,
                 guidelines=guidelines or (env.load_guidelines(beside) if beside else None))
    tasks = env.load_tasks(tasks_path)[:a.n_tasks]
    if not tasks:
        raise SystemExit(f"evaluate.py: no tasks in {tasks_path}")
    return {w.name: (w, tasks)}

def run(a):
    """Every model in every world the flags name; print and write the table. -> {model: {world: summary}}."""
    worlds, out = named_worlds(a), a.out or "out/eval"
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out, exist_ok=True)
    ks = list(range(1, max(w.trials or a.k for w, _ in worlds.values()) + 1))
    results, every = {}, []  # every: each episode, lightened: a run that scored nothing must not exit 0
    for name, path in parse_models(a.models).items():
        gen, tok, chat = load_agent(path, backend=a.backend, endpoint_model=a.agent_model or name, device=device,
                                    thinking=a.thinking, concurrency=a.llm_concurrency, deadline=a.llm_deadline,
                                    vllm_gpu_memory=a.vllm_gpu_memory, max_model_len=a.max_len + a.max_new_tokens,
                                    seed=a.seed)
        agent = (TextAgents(lambda task, seed: ChatAgent(chat, a.max_new_tokens, a.temperature, seed,
                                                         deadline=4 * a.llm_deadline)) if chat else
                 TokenAgent(gen, tok, max_new_tokens=a.max_new_tokens, temperature=a.temperature, max_len=a.max_len))
        results[name] = {}
        for wname, (world, tasks) in worlds.items():
            world.begin(name, native_tools=chat is not None)
            k = world.trials or a.k
            eps = evaluate(agent, world, tasks, k=k, seed=a.seed, batch=a.batch, basis="db" if a.db_only else "task")
            write_transcripts(os.path.join(out, f"{name}_{wname}.jsonl"), eps)
            s = results[name][wname] = summarize(eps, ks, world)
            print(f"{name} / {wname}: pass^1 {_fmt(s['all']['pass^1'])} over {s['all']['n']} tasks, pass@{k} "
                  f"{_fmt(s['all'].get(f'pass@{k}'))} (solved in at least one of {k} trials), "
                  f"{s['all']['errored']} errored episodes", flush=True)
            if s["all"]["errored"]:
                print(f"  {name}: {errored_summary(eps)}", flush=True)
            every += [argparse.Namespace(errored=e.errored, error=e.error, end_reason=e.end_reason) for e in eps]
        if hasattr(gen, "shutdown"):  # a vLLM engine frees its memory before the next model's starts
            gen.shutdown()
    table = markdown(results, [n for n in (1, 2, 4, 8) if n <= len(ks)])
    print(table)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    if every and all(e.end_reason == "agent_error" for e in every):  # scored 0 by BFCL, but nothing was measured
        unit = next(iter(worlds.values()))[0].unit
        raise SystemExit(f"evaluate.py: every {unit}'s agent endpoint failed ({len(every)} of {len(every)}), the first "
                         f"because {short_reason(every[0].error)}; nothing was measured (transcripts in {out})")
    if all_errored(every):
        raise SystemExit(f"evaluate.py: {all_errored(every)}; nothing was scored (transcripts in {out})")
    return results


# ----------------------------------------------------------------------------------------------------
# BFCL v3 multi-turn (--bench bfcl; `pip install --no-deps -r requirements-bfcl.txt`), a world used only here. Each
# entry is one episode: a replaying user says the entry's user turns in order, the tools are the entry's function
# docs as JSON-schema tools, and calls run in bfcl-eval's own backends. A turn lasts until the agent answers without
# a tool call. Each turn's calls, read back from the transcript, go to bfcl-eval's own multi_turn_checker. Accuracy
# is BFCL's: entries passed / entries (an endpoint that failed fails its entry), and the unweighted mean of the four
# categories. Safety: bfcl-eval runs calls with eval() of call strings; ours are built from parsed JSON only (a name
# among the entry's functions, identifier argument names, repr() of JSON values). Model text never reaches eval.

BFCL_CATEGORIES = ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
BFCL_INSTALL = "pip install --no-deps -r requirements-bfcl.txt"
_bfcl = {}

class BFCL(env.World):
    """BFCL v3's multi-turn categories: tasks are entries {"id", "kind": category, "entry"}, one trial each."""
    name, trials, unit = "bfcl", 1, "entry"

    def __init__(self, categories=None, n=None, max_turns=None):
        self.categories = bfcl_categories(categories)
        self.tasks = [{"id": e["id"], "kind": e["category"], "entry": e} for e in bfcl_entries(self.categories, n)]
        # BFCL fails an entry once a turn takes more than 20 steps (bfcl_decode); until then nothing else may stop it
        limit = bfcl()["prompts"].MAXIMUM_STEP_LIMIT + 1
        super().__init__(max_turns=max_turns or limit * max(len(t["entry"]["question"]) for t in self.tasks))
        self.run_name, self.fc = "mua_bfcl", False

    def begin(self, run_name, native_tools=False):
        self.run_name, self.fc = "mua_" + re.sub(r"\W", "_", run_name), native_tools  # bfcl-eval keys by it
        bfcl_reset(self.run_name)

    def reset(self, task):
        return BFCLState(task["entry"], self.run_name, self.fc)

    def opening(self, task, state):
        return []  # no system prompt: BFCL's FC handlers send none, the template's tool preamble is the instruction

    def user(self, task, state, seed):
        return state.user

    def schemas(self, state):
        return state.tools()

    def call(self, state, name, arguments, side="agent"):
        return bfcl_call(state, name, arguments)

    def score(self, ep, task, basis="task"):
        """bfcl-eval's multi_turn_checker; a result with fewer turns than the gold fails first, as in its runner."""
        e, decoded = task["entry"], bfcl_decode(ep.messages, ep.state)
        if len(decoded) != len(e["ground_truth"]):
            res = {"valid": False, "error_type": "multi_turn:force_terminated",
                   "error_message": f"{len(decoded)} turns played of {len(e['ground_truth'])}"}
        else:
            res = bfcl()["checker"](decoded, e["ground_truth"], e, e["category"], self.run_name)
        ep.reward_info = {"valid": bool(res["valid"]), "error_type": res.get("error_type"),
                          "error_message": res.get("error_message"), "decoded": decoded}
        ep.reward = float(ep.reward_info["valid"])
        bfcl_reset(self.run_name, e["id"])

    def summary(self, eps):
        """Each category's entries, passed entries and accuracy, an entry whose endpoint failed counted as failed
        (BFCL's rule), and the unweighted mean of the four (None unless all four ran, where BFCL shows N/A)."""
        out = {}
        for c in self.categories:
            hits = [e.reward == 1.0 and not e.errored for e in eps if e.kind == c]
            out[c] = {"n": len(hits), "correct": sum(hits), "accuracy": sum(hits) / len(hits) if hits else None}
        accs = [out[c]["accuracy"] for c in BFCL_CATEGORIES if c in out]
        full = len(accs) == len(BFCL_CATEGORIES) and None not in accs
        return {**out, "overall": {"accuracy": sum(accs) / len(accs) if full else None}}


# ----------------------------------------------------------------------------------------------------
# ACEBench's agent categories (--bench acebench), worlds used only here, on our own copy of ACEBench's five sandbox
# classes and its checker (chenchen0103/ACEBench 56dd66c, English data). The agent writes calls as ACEBench's
# `[f(a='x'), g()]` (parsed by ast, literals only, never evaluated) or as tool calls; a call runs on every instance
# of the entry's classes that has the method, the last one's result answering it, as in ACEBench. multi_turn: an LLM
# user (its own rules, our wording) talks to the agent; multi_step: the question alone, the agent's plain texts
# answered by ACEBench's execution role. Either side's "finish conversation", or 40 messages, end an entry. The
# score is ACEBench's: the end state of the saved attributes against the possible answer (end-to-end accuracy), and
# the share of milestones found in order among the executed messages (process accuracy; 1 where the end is right).

ACE_CATEGORIES = ["multi_turn", "multi_step"]
ACE_FILES = {c: (f"data_agent_{c}.json", f"possible_answer/data_agent_{c}.json") for c in ACE_CATEGORIES}
ACE_STATES = "default_states.json"  # each sandbox class's state at construction
ACE_MAX_MESSAGES = 40
ACE_FINISH = "finish conversation"
ACE_ASK = "Please do not ask me any questions, use the known conditions to solve the problem"  # multi_step's answer
ACE_SAVED = {"BaseApi": ["wifi", "logged_in"], "MessageApi": ["inbox"], "ReminderApi": ["reminder_list"],
             "FoodPlatform": ["users", "logged_in_users", "orders"], "Travel": ["users", "reservations"]}
ACE_PROMPT = ("You are an assistant that acts through the functions below for the user. Call them as "
              "[func_name(arg='value', other=2)], several at once as [f(a=1), g(b='x')], and write nothing else "
              "in a message that calls. One step at a time: decide the next call from the results. {rules}When the "
              "task is done, reply 'finish conversation'.")
ACE_RULES = {  # our short wording of each scene's rules (ACEBench's own prompts are longer)
    "phone": "The current time is 2024-06-11 16:00. The phone may need login_device() and turn_on_wifi(); the food "
             "platform needs login_food_platform(). The names users give are full names. ",
    "travel": "The current time is 2024-07-15 08:00. Before booking or changing a reservation, get the user's ID "
              "and password and confirm the details; ask how they want to pay (cash or bank). ",
}
ACE_USER_RULES = """You are a user talking to an assistant about the instruction below.
- Write one line per message, as the user.
- Give only what the current step needs, in your own words; never make up what the instruction does not say.
- Confirm what the instruction asks for; answer the assistant's questions as the instruction says.
- When everything in the instruction is done, reply with a separate line: finish conversation"""

class ACEBench(env.World):
    """One ACEBench agent category: tasks {"id", "kind", "entry", "answer"}, each played once."""
    trials, unit = 1, "entry"

    def __init__(self, category, folder=None, n=None, user=None, max_turns=None, tasks=None):
        self.category, self.name = category, f"acebench_{category}"
        self.tasks, self.defaults = tasks or ace_tasks(category, folder, n), ace_default_states(folder)
        super().__init__(user=user, guidelines=ACE_USER_RULES, max_turns=max_turns or ACE_MAX_MESSAGES)

    def reset(self, task):
        return AceState(task["entry"], self.defaults)

    def schemas(self, state):
        return state.tools

    def opening(self, task, state):
        rules = ACE_RULES["travel" if "Travel" in task["entry"]["involved_classes"] else "phone"]
        system = {"role": "system", "content": ACE_PROMPT.format(rules=rules)}
        return [system] + ([{"role": "user", "content": task["entry"]["question"]}]
                           if self.category == "multi_step" else [])

    def user(self, task, state, seed):
        if self.category == "multi_step":
            return None  # the question opens it; nobody answers texts but the execution role
        if self.user_spec == "gold":  # tests: the question, then the end at the agent's first words
            return env.ReplayUser([task["entry"]["question"], ACE_FINISH])
        if self.user_spec is None or isinstance(self.user_spec, str):
            raise SystemExit("ACEBench multi_turn needs an LLM user: --user URL --user-model NAME, or a model path")
        return super().user(task, state, seed)

    def parse(self, text):
        """ACEBench's form (the whole text a call list) or tool calls; a text with "finish conversation" never
        calls (ACEBench stops before running it). multi_step answers any other text with its execution role's
        words. "ace" holds what ACEBench records of a message it executes: the text its milestones are matched on."""
        calls = None if ACE_FINISH in text else ace_decode(text, strict=self.category == "multi_turn")
        if calls is None:
            msg = env.parse_assistant(text) if ACE_FINISH not in text else {"role": "assistant", "content": text}
            if msg.get("tool_calls") and not any("error" in c for c in msg["tool_calls"]):
                msg["ace"] = ace_render([(c["function"]["name"], c["function"]["arguments"])
                                         for c in msg["tool_calls"]])
            elif self.category == "multi_step" and ACE_FINISH not in text:
                msg["ace"] = text
                msg["tool_calls"] = [{"type": "function", "function": {"name": "", "arguments": {}}, "error": ACE_ASK}]
            return msg
        return {"role": "assistant", "content": text, "ace": text,
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}

    def call_all(self, requests):
        """One message's calls (consecutive requests on one state) run in order, each on every instance with its
        method. A name no instance has repeats the message's last result (ACEBench's stale variable), or fails.
        multi_turn: a call that raises stops the message, all of it answered by ACEBench's unformatted error text;
        multi_step: that call alone is answered by its error."""
        out = []
        for _, group in itertools.groupby(requests, key=lambda r: id(r[0])):
            group = list(group)
            state, res, last = group[0][0], [], None
            for _, name, args, _ in group:
                try:
                    last = ace_run(state, name, args, last)
                    res.append((last, False))
                except Exception as e:  # noqa: BLE001 - whatever the model wrote, as ACEBench's eval() would fail
                    if self.category == "multi_turn":
                        res = [("Error during execution: {str(e)}", True)] * len(group)
                        break
                    res.append((f"Error during execution: {e}", True))
            state.recorded = state.recorded or not (self.category == "multi_turn" and res[-1][1])
            out += res
        return out

    def end(self, ep):
        """ACEBench's loop, one message per agent text, user text or execution answer after the opening user's:
        "finish conversation" in any from the third on, or 40 of them. A user's stop stands."""
        if ep.end_reason:
            return ep.end_reason
        seq = []
        for m in [m for m in ep.messages if m["role"] != "system"][1:]:
            if m["role"] == "tool":
                seq += [] if seq and seq[-1] is None else [None]  # one execution answer per message
            else:
                seq.append(m.get("content") or "")
        if any(ACE_FINISH in s for s in seq[2:] if s is not None):
            return "finish"
        return "max_messages" if len(seq) >= ACE_MAX_MESSAGES else None

    def score(self, ep, task, basis="task"):
        """ACEBench's agent checker on the end state, and its process accuracy on the executed messages."""
        state = ace_end_state(ep.state)
        valid, errors = ace_check(state, task["answer"]["ground_truth"])
        process = [m["ace"] for m in ep.messages if "ace" in m]
        ep.reward = float(valid)
        ep.reward_info = {"valid": valid, "errors": errors, "end_state": state, "process": process,
                          "process_accuracy": 1.0 if valid else ace_process(process, task["answer"]["mile_stone"])}

    def summary(self, eps):
        """ACEBench's two figures, rounded as it rounds: entries right at the end, and the mean process accuracy."""
        n = len(eps)
        return {"end_to_end_accuracy": round(sum(e.reward == 1.0 for e in eps) / n, 3) if n else None,
                "process_accuracy": round(sum((e.reward_info or {}).get("process_accuracy", 0) for e in eps) / n, 3)
                if n else None}


# ====================================================================================================
# Machinery: a first reading stops here. bfcl-eval's pieces (its data and types, call strings, its backends'
# state), then ACEBench's.
# ====================================================================================================

def bfcl():
    """bfcl-eval's pieces we use, imported once. bfcl_eval.utils creates folders under BFCL_PROJECT_ROOT when
    imported (its default is beside the installed package), so it gets a temp folder of ours unless set."""
    if not _bfcl:
        os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "mua_rl_bfcl"))
        try:
            from bfcl_eval import utils
            from bfcl_eval.constants import default_prompts, type_mappings
            from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
        except ImportError as e:
            raise SystemExit(f"--bench bfcl needs bfcl-eval ({e.name or e} is missing): {BFCL_INSTALL}") from None
        _bfcl.update(utils=utils, prompts=default_prompts, types=type_mappings.GORILLA_TO_OPENAPI,
                     checker=multi_turn_checker.multi_turn_checker, exec_utils=multi_turn_utils)
    return _bfcl

def bfcl_categories(names):
    """--categories ("base" or "multi_turn_base") -> bfcl-eval's names; an unknown one lists the valid ones."""
    out = []
    for c in names or BFCL_CATEGORIES:
        full = c if c.startswith("multi_turn_") else f"multi_turn_{c}"
        if full not in BFCL_CATEGORIES:
            raise SystemExit(f"unknown BFCL category {c!r}; valid: {', '.join(BFCL_CATEGORIES)}")
        out.append(full)
    return out

def bfcl_entries(categories, n=None):
    """The first n entries of each category as bfcl-eval loads them (load_dataset_entry fills "function" and
    moves miss_func's held-out docs to "missed_function"), each with its gold answer and its category."""
    utils, entries = bfcl()["utils"], []
    for c in categories:
        for e, gold in zip(utils.load_dataset_entry(c)[:n], utils.load_ground_truth_entry(c)[:n]):
            assert e["id"] == gold["id"], (e["id"], gold["id"])
            entries.append({**e, "category": c, "ground_truth": gold["ground_truth"]})
    return entries

def bfcl_tool(doc):
    """A BFCL function doc -> an OpenAI-style tool. BFCL's types ("dict", "float", "tuple", "any", ...) become
    JSON-schema types by bfcl-eval's own map; the doc's "response" schema describes no argument and is left out."""
    types = bfcl()["types"]

    def retype(node):
        if isinstance(node, list):
            return [retype(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: types.get(v, "string") if k == "type" and isinstance(v, str) else retype(v) for k, v in node.items()}
    return {"type": "function", "function": {"name": doc["name"], "description": doc["description"],
                                             "parameters": retype(doc["parameters"])}}

class BFCLState:
    """One entry's episode state: the entry, its tool schemas, its replaying user (whose turn says which held-out
    docs are back), and the name bfcl-eval keeps its backend instances under."""

    def __init__(self, entry, run_name, fc=False):
        self.entry, self.run_name, self.fc = entry, run_name, fc
        self.shown = [bfcl_tool(d) for d in entry["function"]]
        held = entry.get("missed_function", {})
        self.held = {int(t): [bfcl_tool(d) for d in docs] for t, docs in held.items()}
        # any of the entry's functions runs, held-out ones too, as in BFCL (which runs any method of the entry's
        # classes); miss_func_49's gold calls `tail` two turns before its doc comes back
        self.names = {d["name"] for d in entry["function"]} | {d["name"] for ds in held.values() for d in ds}
        self.user = env.ReplayUser(self.user_turns())

    def user_turns(self):
        """The entry's user turns. Where miss_func's held-out functions come back the data has no message: BFCL's
        own stands in, with the docs in it for a local model (its prompting handlers' wording)."""
        p, turns = bfcl()["prompts"], []
        for t, msgs in enumerate(self.entry["question"]):
            if msgs:
                turns.append("\n".join(m["content"] for m in msgs))
            elif self.fc:
                turns.append(p.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC)
            else:
                turns.append(p.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                    functions=json.dumps(self.held[t])))
        return turns

    def tools(self):
        """The schemas of the moment: held-out docs join at their turn for an endpoint (BFCL's FC mode). A local
        model keeps its first ones (a new system turn would change the prompt's start, not extend it)."""
        back = [s for t, ss in sorted(self.held.items()) if t <= self.user.turn for s in ss] if self.fc else []
        return self.shown + back

def _is_json(v):
    """JSON data, of exactly the built-in types (no subclass with its own repr): repr() writes a Python literal."""
    if type(v) is list:
        return all(map(_is_json, v))
    if type(v) is dict:
        return all(type(k) is str and _is_json(x) for k, x in v.items())
    return v is None or type(v) in (str, bool, int) or (type(v) is float and math.isfinite(v))

def call_string(name, args, names):
    """A parsed tool call -> the string bfcl-eval evaluates, 'name(arg=repr(value), ...)'. Raises ValueError
    unless the name is one of the entry's functions, the arguments a JSON object with identifier names."""
    if name not in names:
        raise ValueError(f"unknown function {name!r}; the functions are {', '.join(sorted(names))}")
    if not isinstance(args, dict):
        raise ValueError("the arguments must be a JSON object")
    for k, v in args.items():
        if not k.isidentifier() or keyword.iskeyword(k):
            raise ValueError(f"{k!r} is not a valid argument name")
        if not _is_json(v):
            raise ValueError(f"argument {k!r} is not JSON data")
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"

def bfcl_call(world, name, args):
    """run_episodes' call_tool: one call, run in the entry's bfcl-eval backends. -> (result text, is_error)."""
    try:
        call = call_string(name, args, world.names)
    except ValueError as e:
        return f"Error: {e}", True
    e = world.entry
    out, _ = bfcl()["exec_utils"].execute_multi_turn_func_call(
        [call], e["initial_config"], e["involved_classes"], world.run_name, e["id"],
        long_context="long_context" in e["id"], is_evaL_run=False)
    return out[0], out[0].startswith("Error during execution")

def bfcl_decode(messages, world):
    """A transcript -> BFCL's decoded model result: per user turn, per assistant message that made valid calls
    (a step), the list of call strings it ran. Steps past BFCL's limit end the entry at that turn (BFCL's force
    quit: fewer turns than the gold fail)."""
    turns = []
    for m in messages:
        if m["role"] == "user":
            turns.append([])
        elif m["role"] == "assistant" and turns:
            step = []
            for c in m.get("tool_calls", []):
                try:
                    step.append(call_string(c["function"]["name"], c["function"]["arguments"], world.names))
                except ValueError:
                    pass  # answered with an error, never run: BFCL would not have run it either
            if step:
                turns[-1].append(step)
    turns = turns[:len(world.entry["question"])]  # the user's closing ###STOP### is no turn
    limit = bfcl()["prompts"].MAXIMUM_STEP_LIMIT
    for t, steps in enumerate(turns):
        if len(steps) > limit:
            return turns[:t] + [steps[:limit + 1]]
    return turns

def bfcl_reset(run_name, entry_id=None):
    """Drop the backend instances bfcl-eval keeps in its module globals, keyed by model name and entry id (the
    rollout's, the checker's and the gold's), so another run of the same entries starts from the initial state."""
    g, mark = vars(bfcl()["exec_utils"]), re.sub(r"[-./:]", "_", f"_{entry_id}_") if entry_id else ""
    for key in [k for k in g if k.startswith(run_name + "_") and k.endswith("_instance") and mark in k]:
        del g[key]


# ----------------------------------------------------------------------------------------------------
# ACEBench's pieces: its data (found by file name), the call form, the run on the sandbox, the checker, and our own
# copy of its five sandbox classes (their names, arguments, answers and failures kept: the agent sees them).

def ace_folder(folder=None):
    """--acebench-dir, else $MUA_ACEBENCH_DIR, else ../shared/acebench (chenchen0103/ACEBench, any layout)."""
    return Path(folder or os.environ.get("MUA_ACEBENCH_DIR") or "../shared/acebench")

def ace_find(folder, rel):
    """The file `rel` (a name, or possible_answer/<name>) anywhere under the folder, English data first."""
    hits = sorted((p for p in Path(folder).rglob(Path(rel).name) if p.as_posix().endswith(rel)),
                  key=lambda p: ("data_zh" in p.as_posix(), "data_en" not in p.as_posix(), len(p.parts)))
    if not hits:
        raise SystemExit(f"evaluate.py: ACEBench file {rel} not found under {folder} (--acebench-dir)")
    return hits[0]

def ace_read(path):
    """One JSON object a line (ACEBench's files), or one JSON list."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                      if x.strip()]
    except json.JSONDecodeError as e:
        raise SystemExit(f"evaluate.py: {path} is not ACEBench's JSON lines ({e})") from None

def ace_tasks(category, folder=None, n=None):
    """A category's first n entries, each with its possible answer (matched by id)."""
    folder = ace_folder(folder)
    data, answers = (ace_read(ace_find(folder, rel)) for rel in ACE_FILES[category])
    answers = {a["id"]: a for a in answers}
    return [{"id": e["id"], "kind": category, "entry": e, "answer": answers[e["id"]],
             "user_scenario": {"instructions": e["question"]}} for e in data[:n]]  # what an LLM user is told

def ace_default_states(folder=None):
    """default_states.json from the data folder, else the copy committed in tests/acebench (built from ACEBench's
    constructors); it must hold every attribute the committed copy has. Digit keys (message, reminder ids) -> ints."""
    own = Path(__file__).resolve().parent / "tests" / "acebench" / ACE_STATES
    hits = sorted(ace_folder(folder).rglob(ACE_STATES)) if ace_folder(folder).is_dir() else []
    path = hits[0] if hits else own
    states = json.loads(path.read_text(), object_hook=lambda d: {int(k) if k.isdigit() else k: v for k, v in d.items()})
    for name, attrs in json.loads(own.read_text()).items():
        missing = sorted(set(attrs) - set(states.get(name, {})))
        if missing:
            raise SystemExit(f"evaluate.py: {path} has no {name}.{missing[0]} (each class's state at construction)")
    return states

def ace_value(node):
    """An argument's ast node -> its value: literals, lists, tuples, dicts, negative numbers, and a bare name as
    its string (as ACEBench reads it). Anything else raises ValueError: nothing is evaluated."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return (list if isinstance(node, ast.List) else tuple)(ace_value(x) for x in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {ace_value(k): ace_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name):
        return node.id
    raise ValueError(f"not a literal: {type(node).__name__}")

def ace_decode(text, strict=True):
    """ACEBench's reading of an agent text as calls: brackets added where missing, then the text stripped of
    brackets and quotes at both ends and parsed. -> [(name, {arg: value})], or None where ACEBench would not
    run it. Positional arguments are dropped, as ACEBench drops them; an argument that is a dict is refused (ACEBench
    reads it as a nested call); strict (its agent's check): every element a call, else (its execution role) other
    elements skipped."""
    if not text:
        return None
    text = text[1:] if text[0] == " " else text
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    try:
        body = ast.parse(text.strip("[]'"), mode="eval").body
        elts = [body] if isinstance(body, ast.Call) else body.elts if isinstance(body, (ast.List, ast.Tuple)) else []
        if strict and not all(isinstance(e, ast.Call) for e in elts):
            return None
        calls = []
        for e in (e for e in elts if isinstance(e, ast.Call)):
            parts, f = [], e.func
            while isinstance(f, ast.Attribute):
                parts, f = [f.attr] + parts, f.value
            if not isinstance(f, ast.Name) or any(k.arg is None for k in e.keywords):
                return None
            args = {k.arg: ace_value(k.value) for k in e.keywords}
            if any(isinstance(v, dict) for v in args.values()):  # ACEBench renders such a dict as a call, and fails
                return None
            calls.append((".".join([f.id] + parts), args))
        return calls or None
    except (SyntaxError, ValueError, RecursionError):
        return None

def ace_render(calls):
    """Tool calls -> ACEBench's text form, as its milestones write them: [f(a='x'), g()]."""
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in (a if isinstance(a, dict) else {}).items())
                           + ")" for n, a in calls) + "]"

class AceState:
    """One entry's sandbox: an instance of each involved class loaded as ACEBench loads it (its own config, then
    BaseApi's), its tools, and whether ACEBench would have recorded its end state (a message it ran)."""

    def __init__(self, entry, defaults):
        self.instances = {}
        for name in entry["involved_classes"]:
            inst = ACE_CLASSES[name](defaults.get(name, {}))
            for config in (entry["initial_config"].get(name, {}), entry["initial_config"].get("BaseApi", {})):
                inst._load_scenario(copy.deepcopy(config))
            self.instances[name] = inst
        self.tools, self.recorded = [ace_tool(d) for d in entry["function"]], False

def ace_run(state, name, args, last):
    """One call on every instance with a public method `name`, in class order -> the last one's result as
    ACEBench writes it (a dict as JSON, a string as it is, anything else str()). Raises what the method raises."""
    methods = [getattr(i, name) for i in state.instances.values()
               if not name.startswith("_") and callable(getattr(type(i), name, None))]
    if not methods:
        if last is None:
            raise NameError("cannot access local variable 'func_call_result' where it is not associated with a value")
        return last
    if not isinstance(args, dict):
        raise TypeError("the arguments must be keywords")
    for method in methods:
        result = method(**copy.deepcopy(args))
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return result if isinstance(result, str) else str(result)

def ace_tool(doc):
    """An ACEBench function doc -> an OpenAI-style tool (its "dict"/"list" types as JSON schema's)."""
    types = {"dict": "object", "list": "array", "float": "number", "int": "integer"}

    def retype(node):
        if isinstance(node, list):
            return [retype(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: types.get(v, v) if k == "type" and isinstance(v, str) else retype(v) for k, v in node.items()}
    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": retype(doc.get("parameters", {}))}}

def ace_end_state(state):
    """ACEBench's model result: per involved class its saved attributes, as read back from its result file (JSON:
    int keys as strings); empty when no message of the episode ran to its end (ACEBench recorded none)."""
    out = [{name: {k: v for k, v in vars(inst).items() if k in ACE_SAVED[name]}}
           for name, inst in state.instances.items()] if state.recorded else []
    return json.loads(json.dumps(out, ensure_ascii=False, default=str))

def ace_check(result, answer):
    """ACEBench's agent_eval on one entry -> (valid, errors). As there: the class counts must match; each answer
    class is checked against the result's class of the same name, and one with no such class is not checked (a
    misspelled answer class checks nothing); a dict attribute is checked key by key of the answer's."""
    answer = answer if isinstance(answer, list) else [answer]
    if len(answer) != len(result):
        return False, ["wrong number of class"]
    errors, got = [], {k: v for r in result for k, v in r.items()}
    for item in answer:
        (name, want), = item.items()
        for attr, value in got.get(name, {}).items() if name in got else []:
            if attr not in want:
                errors.append(f"class({name}) attributes({attr}) missing in possible_answer.")
            elif isinstance(want[attr], dict):
                errors += [f"class({name}) attributes({attr}.{k}) wrong" for k, v in want[attr].items()
                           if k not in value or value[k] != v]
            elif want[attr] != value:
                errors.append(f"class({name}) attributes({attr}) wrong")
    return not errors, errors

def ace_process(process, milestones):
    """ACEBench's process accuracy of an entry: milestones found in order among the executed messages (stripped
    texts equal), over their count; the best of several milestone lists."""
    def found(stones):
        i, hits = 0, 0
        for stone in stones:
            while i < len(process):
                i += 1
                if process[i - 1].strip() == stone.strip():
                    hits += 1
                    break
        return round(hits / len(stones), 3) if stones else 1.0
    return max(map(found, milestones)) if milestones and isinstance(milestones[0], list) else found(milestones)

class BaseApi:
    """The phone: Wi-Fi and the device login. Every class starts from its default state (default_states.json)."""

    def __init__(self, default):
        self.__dict__.update(copy.deepcopy(default))

    def _load_scenario(self, scenario):
        self.wifi, self.logged_in = scenario.get("wifi", False), scenario.get("logged_in", True)

    def turn_on_wifi(self):
        self.wifi = True
        return {"status": True, "message": "Wi-Fi has been turned on"}

    def login_device(self):
        self.logged_in = True
        return {"status": True, "message": "Device has been logged in"}

def _no(message):
    return {"status": False, "message": message}

class MessageApi(BaseApi):
    """Text messages between six users: inbox {id: {sender_id, receiver_id, message, time}}, max_capacity of them."""

    def send_message(self, sender_name, receiver_name, message):
        if self.logged_in == False:  # noqa: E712 - ACEBench's comparisons, kept for values that are not bools
            return _no("Device not logged in, unable to send message")
        if self.wifi == False:  # noqa: E712
            return _no("Wi-Fi is turned off, cannot send messages at this time")
        if len(self.inbox) >= self.max_capacity:
            return _no("Inbox capacity is full. You need to ask the user which message to delete.")
        if sender_name not in self.user_list or receiver_name not in self.user_list:
            return _no("Sender or receiver does not exist")
        self.message_id_counter += 1  # a sent message has no time: get_latest/earliest_message_id then fail
        self.inbox[self.message_id_counter] = {"sender_id": self.user_list[sender_name]["user_id"],
                                               "receiver_id": self.user_list[receiver_name]["user_id"],
                                               "message": message}
        return {"status": True, "message": f"Message successfully sent to {receiver_name}."}

    def delete_message(self, message_id):
        if self.logged_in == False:  # noqa: E712
            return _no("Device not logged in, unable to delete message")
        if message_id not in self.inbox:
            return _no("Message ID does not exist")
        del self.inbox[message_id]
        return {"status": True, "message": f"Message ID {message_id} has been successfully deleted."}

    def view_messages_between_users(self, sender_name, receiver_name):
        if self.logged_in == False:  # noqa: E712
            return _no("Device not logged in, unable to view message information")
        if sender_name not in self.user_list:
            return _no("Sender does not exist")
        if receiver_name not in self.user_list:
            return _no("Receiver does not exist")
        ids = (self.user_list[sender_name]["user_id"], self.user_list[receiver_name]["user_id"])
        found = [{"id": i, "sender": sender_name, "receiver": receiver_name, "message": m["message"]}
                 for i, m in self.inbox.items() if (m["sender_id"], m["receiver_id"]) == ids]
        return {"status": True, "messages": found} if found else _no("No related message records found")

    def search_messages(self, user_name, keyword):
        if user_name not in self.user_list:
            return _no("User does not exist")
        uid = self.user_list[user_name]["user_id"]
        found = [{"id": i, "sender_id": m["sender_id"], "receiver_id": m["receiver_id"], "message": m["message"]}
                 for i, m in self.inbox.items()
                 if uid in (m["sender_id"], m["receiver_id"]) and keyword.lower() in m["message"].lower()]
        return {"status": True, "messages": found} if found else _no("No messages found containing the keyword")

    def get_all_message_times_with_ids(self):
        if self.logged_in == False:  # noqa: E712
            return _no("Device not logged in, unable to retrieve all message times and their corresponding "
                       "message IDs.")
        return {i: m["time"] for i, m in self.inbox.items()}

    def _extreme_message_id(self, which, later):
        if self.logged_in == False:  # noqa: E712
            return _no(f"Device not logged in, unable to retrieve the {which} sent message ID.")
        if not self.inbox:
            return _no("No message records found")
        best_id = best = None
        for i, m in self.inbox.items():
            t = datetime.strptime(m["time"], "%Y-%m-%d")
            if best is None or (t > best if later else t < best):
                best_id, best = i, t
        return {"status": True, "message": f"The {which} message ID is {best_id}", "message_id": best_id}

    def get_latest_message_id(self):
        return self._extreme_message_id("latest", True)

    def get_earliest_message_id(self):
        return self._extreme_message_id("earliest", False)

class ReminderApi(BaseApi):
    """Reminders: reminder_list {id: {reminder_id, title, description, time, notified}}, max_capacity of them."""

    def view_reminder_by_title(self, title):
        if self.logged_in == False:  # noqa: E712
            return _no("The device is not logged in, so you cannot view notifications")
        for r in self.reminder_list.values():
            if r["title"] == title:
                return {"status": True, "reminder": r}
        return _no(f"No reminder found with the title '{title}'.")

    def add_reminder(self, title, description, time):
        if self.logged_in == False:  # noqa: E712
            return _no("Device not logged in. Unable to add a new reminder.")
        if len(self.reminder_list) >= self.max_capacity:
            return _no("Reminder capacity is full. Unable to add a new reminder.")
        self.reminder_id_counter += 1
        self.reminder_list[self.reminder_id_counter] = {"reminder_id": self.reminder_id_counter, "title": title,
                                                        "description": description, "time": time, "notified": False}
        return {"status": True, "message": f"Reminder '{title}' was successfully added."}

    def delete_reminder(self, reminder_id):
        if self.logged_in == False:  # noqa: E712
            return _no("Device not logged in. Unable to delete the specified reminder.")
        if reminder_id not in self.reminder_list:
            return _no("Reminder ID does not exist.")
        del self.reminder_list[reminder_id]
        return {"status": True, "message": f"Reminder ID {reminder_id} was successfully deleted."}

    def view_all_reminders(self):
        if not self.reminder_list:
            return _no("No reminders found.")
        return {"status": True, "reminders": [{k: r[k] for k in ("title", "description", "time", "notified")}
                                              for r in self.reminder_list.values()]}

class FoodPlatform(BaseApi):
    """Food delivery: users {name: {user_id, password, balance}}, merchant_list with menus, logged_in_users, orders."""

    def _load_scenario(self, scenario):
        super()._load_scenario(scenario)
        self.logged_in_users = scenario.get("logged_in_users", [])

    def login_food_platform(self, username, password):
        if self.wifi == False:  # noqa: E712
            return _no("Wi-Fi is not enabled, unable to login")
        if username not in self.users:
            return _no("User does not exist")
        if self.users[username]["password"] != password:
            return _no("Incorrect password")
        if username in self.logged_in_users:
            return _no(f"{username} is already logged in")
        self.logged_in_users.append(username)
        return {"status": True, "message": f"User {username} has successfully logged in!"}

    def view_logged_in_users(self):
        if not self.logged_in_users:
            return _no("No users are currently logged in to the food platform")
        return {"status": True, "logged_in_users": self.logged_in_users}

    def check_balance(self, user_name):
        return self.users[user_name]["balance"] if user_name in self.users else 0.0

    def add_food_delivery_order(self, username, merchant_name, items):
        if username not in self.logged_in_users:
            return _no(f"User {username} is not logged in to the food platform")
        if merchant_name not in self.merchant_list:
            return _no("Merchant does not exist")
        total, lines = 0.0, []
        for item in items:
            product, quantity = item.get("product"), item.get("quantity", 1)
            if not isinstance(quantity, int) or quantity <= 0:
                return _no(f"Invalid quantity {quantity} for product {product}")
            price = next((p["price"] for p in self.merchant_list[merchant_name]["menu"] if p["product"] == product),
                         None)
            if price is None:
                return _no(f"Product {product} does not exist in {merchant_name}'s menu")
            total += price * quantity
            lines.append({"product": product, "quantity": quantity, "price_per_unit": price})
        if total > self.users[username]["balance"]:
            return _no("Insufficient balance to place the order")
        self.users[username]["balance"] -= total
        self.orders.append({"user_name": username, "merchant_name": merchant_name, "items": lines,
                            "total_price": total})
        return {"status": True,
                "message": f"Food delivery order successfully placed with {merchant_name}. Total amount: {total} yuan"}

    def get_products(self, merchant_name):
        merchant = self.merchant_list.get(merchant_name)
        return merchant["menu"] if merchant else _no(f"Merchant '{merchant_name}' does not exist")

    def view_orders(self, user_name):
        mine = [o for o in self.orders if o["user_name"] == user_name]
        return {"status": True, "orders": mine} if mine else _no("User has no order records")

    def search_orders(self, keyword):
        k = keyword.lower()
        found = [o for o in self.orders if k in o["merchant_name"].lower()
                 or any(k in i["product"].lower() for i in o.get("items", []))]
        return {"status": True, "orders": found} if found else _no("No matching orders found")

class Travel:
    """Flights: users {user_id: {user_name, password, cash_balance, bank_balance, membership_level}}, flights,
    reservations. Its checks are ACEBench's, loose ones included (the agent must apply the policy)."""
    FREE_BAGS = {"regular": {"Economy Class": 1, "Business Class": 2}, "silver": {"Economy Class": 2,
                 "Business Class": 3}, "gold": {"Economy Class": 3, "Business Class": 3}}

    def __init__(self, default):
        self.__dict__.update(copy.deepcopy(default))

    def _load_scenario(self, scenario):
        pass

    def get_flight_details(self, origin=None, destination=None):
        flights = [f for f in self.flights if (not origin or f["origin"] == origin)
                   and (not destination or f["destination"] == destination)]
        keys = ("flight_no", "origin", "destination", "depart_time", "arrival_time", "status", "seats_available",
                "economy_price", "business_price")
        return [{k: f[k] for k in keys} for f in flights] if flights else \
            "There are no direct flights that meet the criteria."

    def get_user_details(self, user_id, password):
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return {k: v for k, v in user.items() if k != "password"}
        return {"status": "error", "message": "Incorrect username or password."}

    def get_reservation_details(self, reservation_id=None, user_id=None):
        if reservation_id:
            mine = [r for r in self.reservations if r["reservation_id"] == reservation_id]
        elif user_id:
            mine = [r for r in self.reservations if r["user_id"] == user_id]
        else:
            return {"status": "error", "message": "Please provide a valid reservation ID or user ID"}
        return [{**r, "flight_info": next((f for f in self.flights if f["flight_no"] == r["flight_no"]), None)}
                for r in mine]

    def authenticate_user(self, user_id, password):
        user = self.users.get(user_id)
        if user and user["password"] == password:
            return user
        return {"status": "error", "message": "Incorrect username or password."}  # truthy: callers go on with it

    def get_baggage_allowance(self, membership_level, cabin_class):
        return self.FREE_BAGS.get(membership_level, {}).get(cabin_class, 0)

    def find_transfer_flights(self, origin_city, transfer_city, destination_city):
        def leg(a, b):
            return [f for f in self.flights
                    if f["origin"] == a and f["destination"] == b and f["status"] == "available"]
        at = lambda s: datetime.strptime(s, "%Y-%m-%d %H:%M:%S")  # noqa: E731
        found = [{"first_leg": f1, "second_leg": f2} for f1 in leg(origin_city, transfer_city)
                 for f2 in leg(transfer_city, destination_city) if at(f1["arrival_time"]) < at(f2["depart_time"])]
        return found or "No connecting flights that meet the criteria were found."

    def calculate_baggage_fee(self, membership_level, cabin_class, baggage_count):
        return max(baggage_count - self.FREE_BAGS[membership_level][cabin_class], 0) * 50

    def update_balance(self, user, payment_method, amount):
        key = {"cash": "cash_balance", "bank": "bank_balance"}.get(payment_method)
        if key and user[key] + amount < 0:
            return False
        if key:
            user[key] += amount
        return True

    def reserve_flight(self, user_id, password, flight_no, cabin, payment_method, baggage_count):
        user = self.authenticate_user(user_id, password)
        flight = next((f for f in self.flights if f["flight_no"] == flight_no and f["status"] == "available"), None)
        total = flight["economy_price"] if cabin == "Economy Class" else flight["business_price"]
        total += self.calculate_baggage_fee(user["membership_level"], cabin, baggage_count)
        if payment_method not in ["cash", "bank"]:
            return "Invalid payment method"
        key = payment_method + "_balance"
        if total > self.users.get(user_id)[key]:
            return f"Your {payment_method} balance is insufficient. Please consider using another payment method."
        self.users.get(user_id)[key] -= total
        flight["seats_available"] -= 1
        rid = f"res_{len(self.reservations) + 1}"
        self.reservations.append({"reservation_id": rid, "user_id": user_id, "flight_no": flight_no,
                                  "payment_method": payment_method, "cabin": cabin, "baggage": baggage_count})
        return f"Booking successful. Reservation ID: {rid}. Total cost: {total} yuan (including baggage fees)."

    def modify_flight(self, user_id, reservation_id, new_flight_no=None, new_cabin=None, add_baggage=0,
                      new_payment_method=None):
        res = next((r for r in self.reservations if r["reservation_id"] == reservation_id and r["user_id"] == user_id),
                   None)
        if not res:
            return "Reservation not found or user ID does not match."
        current = next((f for f in self.flights if f["flight_no"] == res["flight_no"]), None)
        if not current:
            return "Flight information not found."
        pay, user, said = new_payment_method or res["payment_method"], self.users[user_id], []
        if new_flight_no and new_flight_no != res["flight_no"]:
            new = next((f for f in self.flights if f["flight_no"] == new_flight_no), None)
            if not (new and (new["origin"], new["destination"]) == (current["origin"], current["destination"])):
                return "Flight change failed: Invalid new flight number or destination does not match."
            res["flight_no"] = new_flight_no
            said.append("Flight number has been changed.")
        if new_cabin and new_cabin != res.get("cabin"):
            diff = self.calculate_price_difference(current, res["cabin"], new_cabin)  # the old flight's prices
            res["cabin"] = new_cabin
            if diff > 0:
                said.append(f"Cabin change successful. Price difference paid: {diff}."
                            if self.update_balance(user, pay, -diff) else
                            "Insufficient balance to pay the cabin price difference.")
            elif diff < 0:
                self.update_balance(user, pay, -diff)
                said.append(f"Cabin change successful. Price difference refunded: {-diff}.")
        if add_baggage > 0:
            total = res.get("baggage", 0) + add_baggage
            cost = max(0, total - self.get_baggage_allowance(user["membership_level"], res["cabin"])) * 50
            if cost > 0:
                said.append(f"Baggage has been added. Additional fee to be paid: {cost}."
                            if self.update_balance(user, pay, -cost) else
                            "Insufficient balance to pay the additional baggage fees.")
            res["baggage"] = total
        return " ".join(said or ["Modification completed with no additional fees."])

    def cancel_reservation(self, user_id, reservation_id, reason):
        now = datetime(2024, 7, 14, 6, 0, 0)  # ACEBench's "current time" for cancellations
        user = self.users.get(user_id, None)
        if not user:
            return "Invalid user ID."
        res = next((r for r in self.reservations if r["reservation_id"] == reservation_id and r["user_id"] == user_id),
                   None)
        if not res:
            return "Invalid reservation ID or it does not belong to the user."
        flight = next((f for f in self.flights if f["flight_no"] == res["flight_no"]), None)
        if not flight:
            return "Invalid flight information."
        depart = datetime.strptime(flight["depart_time"], "%Y-%m-%d %H:%M:%S")
        if now > depart:
            return "The flight segment has been used and cannot be canceled."
        price = flight["economy_price"] if res["cabin"] == "Economy Class" else flight["business_price"]
        if reason == "The airline has canceled the flight.":  # the reservation itself stays, as in ACEBench
            self.process_refund(user, price)
            return f"The flight has been canceled. Your reservation will be canceled free of charge, and {price} " \
                   "yuan has been refunded."
        if depart - now > timedelta(days=1):
            self.process_refund(user, price)
            return f"More than 24 hours before departure. Free cancellation successful, {price} yuan has been refunded."
        fee = price * 0.1
        self.process_refund(user, price - fee)
        return f"Less than 24 hours before departure. A cancellation fee of {fee} yuan has been deducted, and " \
               f"{price - fee} yuan has been refunded."

    def process_refund(self, user, amount):
        user["cash_balance"] += amount

    def calculate_price_difference(self, flight, old_cabin, new_cabin):
        prices = {"Economy Class": flight["economy_price"], "Business Class": flight["business_price"]}
        return prices.get(new_cabin, 0) - prices.get(old_cabin, 0)

ACE_CLASSES = {c.__name__: c for c in (BaseApi, MessageApi, ReminderApi, FoodPlatform, Travel)}


if __name__ == "__main__":
    main()
