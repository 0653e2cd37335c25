"""
evaluate.py: pass^k on held-out tasks, tau-bench's way, for one or more models in one or more worlds (env.World):
the generated shop, tau2-bench's domains on tau2's own code, BFCL v3's multi-turn categories on bfcl-eval's code.

    python evaluate.py                      # the demo's base, cold-start (SFT), MUA-RL (SFT+GRPO), RL-only rows
    python evaluate.py --models sft=out/sft grpo=out/grpo --k 4 --temperature 1.0   # sampled trials
    python evaluate.py --models sft=out/sft --domain retail airline telecom    # tau2's test split, on tau2's code
    python evaluate.py --models out/grpo --tasks ../shared/tau2/retail/tasks.json \
        --db ../shared/tau2/retail/db.json --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B \
        --max-new-tokens 1024 --max-len 16384
    python evaluate.py --bench bfcl --models sft=out/sft --categories base miss_func --n 20   # BFCL subset

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
import json
import keyword
import math
import os
import re
import tempfile
from collections import defaultdict
from math import comb

import torch

import env
from rollout import (TINY_BASE, ChatAgent, TextAgents, TokenAgent, add_user_args, all_errored, check_flags,
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
    g.add_argument("--split", default="test", help="with --domain: tau2's task split (train, test, base; telecom "
                   "also small, full), also of a --tasks file with a split_tasks.json beside it (tau2 v1.0.x)")
    g.add_argument("--judge", default=None, help="with --domain: OpenAI-compatible URL of the LLM that judges "
                                                  "tau2's NL assertions (default: reported as not judged)")
    g.add_argument("--judge-model", default=None, help="model name at the --judge endpoint")
    g.add_argument("--bench", default="tau2", choices=["tau2", "bfcl"],
                   help="tau2: the shop or tau2's domains; bfcl: BFCL v3's multi-turn categories")
    g.add_argument("--categories", nargs="+", default=None, help="with --bench bfcl: with or without 'multi_turn_' "
                                                                  "(default: all four)")
    g.add_argument("--n", type=int, default=None, help="with --bench bfcl: the first n entries of each category")
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
    check_flags(p, a, [  # checked up front: one line naming the flag and what it may be
            ("--k", a.k >= 1, ">= 1"), ("--temperature", a.temperature >= 0, ">= 0 (0: greedy)"),
            ("--n-tasks", a.n_tasks is None or a.n_tasks >= 1, ">= 1"),
            ("--max-turns", a.max_turns is None or a.max_turns >= 1, ">= 1"),
            ("--max-new-tokens", a.max_new_tokens >= 1, ">= 1"), ("--max-len", a.max_len >= 2, ">= 2"),
            ("--batch", a.batch >= 1, ">= 1"), ("--llm-concurrency", a.llm_concurrency >= 1, ">= 1"),
            ("--llm-deadline", a.llm_deadline > 0, "> 0")])
    if a.judge and not a.judge_model:
        p.error("--judge needs --judge-model")
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


# ====================================================================================================
# Machinery: a first reading stops here. bfcl-eval's pieces: its data and types, call strings, its backends' state.
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


if __name__ == "__main__":
    main()
