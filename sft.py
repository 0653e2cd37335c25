"""
sft.py: cold-start supervised fine-tuning (MUA-RL's second stage) on synthesized conversations, in plain PyTorch.

    python sft.py                                        # the committed tiny base (tests/tiny_base), CPU, minutes
    python sft.py --model tiny                           # a tiny Qwen3-style model from scratch instead
    python sft.py --model /path/to/SmolLM2-135M-Instruct --lr 5e-5 --steps 20
    torchrun --nproc_per_node 8 sft.py --model Qwen/Qwen3-0.6B --batch-size 4 --grad-accum 4 --lr 1e-5

The loss is on the agent's tokens only, with the same rendering and masking code rollouts use
(rollout.encode_conversation). Checkpoints are save_pretrained folders (plus optimizer and step state),
written atomically; --resume continues a killed run from the last one.

With --patience N, every --eval-every steps the model plays the tasks of the held-out conversations (--eval-frac of
the training side, never the test split) greedily with the scripted user, and after N validations without a higher
success rate training stops; the run folder's `latest` then names the best validated checkpoint, which is what
grpo.py and evaluate.py load. Off by default: on the demo, 40 tasks judge too noisily to stop a run whose learning
rate has not yet decayed (at 679671b, `--patience 4 --steps 1500 --eval-frac 0.1` stopped at 750-1,000 steps with the
learning rate at 51-74% of its peak, and SFT continued from there beat GRPO by 8 points).

What is simplified, and why:
1. One loop for every model: AdamW, linear warm-up then cosine, gradient accumulation, DDP under torchrun.
   The loss is a token-level mean over the agent tokens of the whole global batch, whatever the micro-batches.
2. The CPU demo starts, as the paper does, from a pretrained base: a ~1M-parameter Qwen3 that
   tests/pretrain_base.py made once and the repository commits (tests/tiny_base, 5 MB): a BPE, a copy curriculum
   that teaches it to copy ids, then language modelling on text of the generated shop (the training users' records
   as tool calls and results, never a test user or a conversation).
   `--model tiny` builds the same model from scratch inside SFT instead; whether its copy circuit forms in time
   then depends on machine and seed. A real checkpoint (`--model PATH`) is used as it is.
3. For the tiny family (the base, or `--model tiny`), every step re-draws the ids and names of its conversations
   (--redraw) and mixes in a few copy sequences (--copy-mix), so a small model must copy ids from the context
   instead of memorizing a few dozen users.
"""
import argparse
import functools
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import env
from rollout import (LOGPROB_CHUNK, TINY_BASE, HFGenerator, ModelSetup, TokenAgent, add_scale_args, all_reduce_sum,
                     autocast, chatml_template, check_flags, claim_or_stop, clip_grad, cpu_threads, encode_conversation,
                     leave_ranks, load_model, load_optimizer_state, load_train_state, logprobs_chunked, open_metrics,
                     pad_batch, point_latest, render, run_episodes, save_checkpoint, set_thinking, setup_distributed,
                     token_logprobs, unwrap)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", default="data/sft.jsonl", help="synth.py's conversations, one JSON object a line")
    g.add_argument("--max-len", type=int, default=2048, help="conversations are truncated to this many tokens")
    g.add_argument("--eval-frac", type=float, default=0.05, help="share of conversations held out, with their tasks: "
                   "their loss is measured, and their tasks are the validation tasks (--patience)")
    g.add_argument("--redraw", default="auto", choices=["auto", "on", "off"],
                   help="re-draw ids and names in every step's conversations (auto: on for the tiny family)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=TINY_BASE,
                   help="the committed tiny base (default), 'tiny' (from scratch, below), or a path / hub id")
    g.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="Qwen3-style templates: enable_thinking on or off (default: the template's)")
    g.add_argument("--vocab-size", type=int, default=2048, help="tiny: BPE tokens, plus 1100 digit-chunk tokens")
    g.add_argument("--d-model", type=int, default=128, help="tiny: hidden size")
    g.add_argument("--n-layer", type=int, default=4, help="tiny: layers")
    g.add_argument("--n-head", type=int, default=4, help="tiny: attention heads")
    g.add_argument("--copy-warmup", type=int, default=900, help="tiny: at most this many short copy steps, + 1/3 long")
    g.add_argument("--copy-mix", type=int, default=4, help="tiny family: copy sequences mixed into every SFT step")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=1200, help="optimizer steps (the schedule's length; --patience may "
                   "stop earlier). 1200: where the demo's training-side validation peaked (600 / 1200 / 1800 steps)")
    g.add_argument("--batch-size", type=int, default=8, help="conversations per micro-batch (per rank)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=5e-3, help="peak learning rate (tiny from scratch; ~1e-5 for an 8B)")
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="seeds the data order, the tiny model and its curriculum")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--out", default="out/sft", help="run folder: metrics.jsonl, step_N/ checkpoints, latest")
    g.add_argument("--eval-every", type=int, default=50, help="held-out evaluation and validation every n steps")
    g.add_argument("--patience", type=int, default=0, help="validate (greedy success on the held-out tasks; needs "
                   "train_tasks.jsonl and shop.json beside --data) and stop after this many validations without a "
                   "higher one; the run's model is then its best (0: no validation, every step runs; see the README)")
    g.add_argument("--save-every", type=int, default=100, help="checkpoint every n steps (and at the end)")
    g.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    g.add_argument("--overwrite", action="store_true", help="delete an earlier run in --out first (else refused)")
    add_scale_args(p)
    a = p.parse_args(argv)
    cpu_threads()  # the same numbers on any CPU (rollout.cpu_threads)
    check_flags(p, a, [  # up front: a bad value would train quietly at loss 0, or crash late
            ("--steps", a.steps >= 1, ">= 1"), ("--batch-size", a.batch_size >= 1, ">= 1"),
            ("--grad-accum", a.grad_accum >= 1, ">= 1"), ("--max-len", a.max_len >= 2, ">= 2"),
            ("--eval-frac", 0 <= a.eval_frac < 1, "in [0, 1)"), ("--lr", a.lr > 0, "> 0"),
            ("--warmup", a.warmup >= 0, ">= 0"), ("--weight-decay", a.weight_decay >= 0, ">= 0"),
            ("--grad-clip", a.grad_clip > 0, "> 0"), ("--eval-every", a.eval_every >= 1, ">= 1"),
            ("--patience", a.patience >= 0, ">= 0"),
            ("--save-every", a.save_every >= 1, ">= 1"), ("--vocab-size", a.vocab_size >= 1, ">= 1"),
            ("--d-model", a.d_model >= 1, ">= 1"), ("--n-layer", a.n_layer >= 1, ">= 1"),
            ("--n-head", a.n_head >= 1 and a.d_model % a.n_head == 0, ">= 1 and a divisor of --d-model"),
            ("--copy-warmup", a.copy_warmup >= 0, ">= 0"), ("--copy-mix", a.copy_mix >= 0, ">= 0")])
    claim_or_stop(p, a.out, a.resume, a.overwrite)
    a = vars(a)
    del a["overwrite"]
    tiny = TinyConfig(*(a.pop(k) for k in ("vocab_size", "d_model", "n_layer", "n_head", "copy_warmup")))
    return train(**a, tiny=tiny if a["model"] == "tiny" else None)

def train(*, data, model, tiny, out, steps, batch_size, grad_accum, lr, warmup, weight_decay, grad_clip, max_len,
          eval_every, eval_frac, save_every, resume, thinking, redraw, copy_mix, seed, fsdp, cpu_offload,
          activation_checkpointing, lora_rank, lora_alpha, patience=0):
    """The SFT loop. `model` is a path or hub id, or ignored when `tiny` (a TinyConfig) builds one from scratch.
    `redraw` is "on", "off" or "auto" (on for the tiny family); `copy_mix` copy sequences join every step of a
    tiny-family model. With `patience`, training stops once that many validations in a row found no higher success
    on the held-out tasks; a validated run's `latest` then names its best checkpoint (best/), and the run is
    finished (--resume continues only a killed run). The last five arguments are
    rollout.add_scale_args' flags. -> (model, tokenizer); under torchrun the process ends instead (leave_ranks)."""
    rank, n_ranks, device = setup_distributed()
    setup = ModelSetup.resolve(fsdp=fsdp, cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                               lora_rank=lora_rank, lora_alpha=lora_alpha, n_ranks=n_ranks, device=device)
    if tiny and lora_rank:
        raise SystemExit("LoRA adapts a pretrained model: give --model a checkpoint")
    if not tiny:
        setup.check_memory(model, seq_len=max_len, micro_batch=batch_size)
    torch.manual_seed(seed)
    convs = load_conversations(data)
    n_eval = max(1, int(len(convs) * eval_frac))
    if len(convs) <= n_eval:  # an empty file trained at loss 0 and saved checkpoints
        raise SystemExit(f"sft.py: {data} holds {len(convs)} conversations: too few to hold out {n_eval} for "
                         "evaluation and train on the rest")
    random.Random(seed).shuffle(convs)
    held_convs, train_convs, held_ids = split_heldout(convs, n_eval)
    val = validation(data, held_ids) if patience else None  # (world, its validation tasks) or None
    if val and setup.fsdp and n_ranks > 1:  # a sharded forward is a collective: ranks' episodes would have to agree
        print("sft.py: no validation with FSDP over several ranks: all --steps run", flush=True)
        val = None
    os.makedirs(out, exist_ok=True)
    start, warm, state = 0, {}, {}
    if resume and os.path.isfile(os.path.join(out, "latest")):  # with LoRA: the base model and the saved adapter
        net, tok = load_model(model if lora_rank else out, **setup.load_kw)
        state = load_train_state(out)  # memory-mapped: AdamW's state is read shard by shard
        start = state["step"]
        if state.get("finished"):  # `latest` names the best checkpoint of a validated run that ended
            print(f"sft.py: {out} has finished; its model is step {start}'s, the best validated (nothing to resume)",
                  flush=True)
            return net, tok
    elif tiny:
        tok, net, warm = tiny_model(convs, tiny, lr=lr, seed=seed, device=device,
                                    init_dir=os.path.join(out, "init") if rank == 0 else None)
    else:
        net, tok = load_model(model, **setup.load_kw)
    set_thinking(tok, thinking)
    family = tiny is not None or is_tiny_family(tok)  # the committed base, its descendants, or --model tiny
    redraw = redraw == "on" or (redraw == "auto" and family)
    copy_mix = CopyMix(tok, copy_mix, seed, device) if family and copy_mix else None

    def encode_truncated(c):  # rollout.encode_conversation, cut at max_len -> (ids, mask)
        ids, mask = encode_conversation(tok, c["messages"], c.get("tools"))
        return ids[:max_len], mask[:max_len]
    held = [encode_truncated(c) for c in held_convs]
    encoded = None if redraw else [encode_truncated(c) for c in train_convs]  # with redraw, each step encodes afresh
    probe = encoded or [encode_truncated(c) for c in train_convs[:32]]
    if not any(sum(m[1:]) for _, m in probe):  # the loss is on agent tokens: with none left it is 0 and learns nothing
        first = min(encode_conversation(tok, c["messages"], c.get("tools"))[1].index(1) for c in train_convs[:32])
        raise SystemExit(f"sft.py: --max-len {max_len} cuts every conversation of {data} before its first agent "
                         f"token (the earliest is token {first}); raise --max-len")
    net = setup.prepare(net, lora_state=state.get("lora"))  # LoRA, then FSDP2 / DDP (rollout.wrap_model)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                            betas=(0.9, 0.95))
    if start:
        load_optimizer_state(net, opt, state["optimizer"])
    log = open_metrics(os.path.join(out, "metrics.jsonl"), start) if rank == 0 else None
    per_step = batch_size * grad_accum * n_ranks
    best = state.get("best", {"success": -1.0, "step": 0, "since": 0})  # the validation record, resumed with the run
    bar = tqdm(range(start, steps), initial=start, total=steps, disable=rank != 0, desc="sft")
    for step in bar:
        t0 = time.time()
        # the global batch of this step depends only on (seed, step), so a resumed run sees the same data
        n = len(train_convs)
        order = random.Random(seed * 1000003 + step // max(1, n // per_step)).sample(range(n), n)
        k = step % max(1, n // per_step)
        picked = order[k * per_step:(k + 1) * per_step]
        glob = [encoded[j] for j in picked] if encoded else [encode_truncated({**train_convs[j], "messages": redraw_ids(
            train_convs[j]["messages"], random.Random(seed * 1000003 + step * 1009 + j))}) for j in picked]
        mine = glob[rank::n_ranks]
        total = max(1.0, float(sum(sum(m[1:]) for _, m in glob)))  # agent tokens in the global batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loss_sum = 0.0
        # every rank runs as many micro-batches (DDP all-reduces in each backward, FSDP all-gathers in each
        # forward): rank 0's share is the largest, and where data is short of a global batch a rank with fewer
        # conversations runs dummies (a conversation of the batch, its loss times 0)
        for a in range(min(grad_accum, math.ceil(len(glob[0::n_ranks]) / batch_size))):
            mb = mine[a * batch_size:(a + 1) * batch_size]
            weight = n_ranks if mb else 0.0  # DDP averages gradients over ranks: * n_ranks keeps the token mean
            loss = micro_loss(net, mb or glob[:1], total, device) * weight
            loss_sum += float(loss.detach()) / n_ranks
            if copy_mix and a == 0:
                loss = loss + copy_mix.loss(net, step, rank)
            loss.backward()
        loss_t = all_reduce_sum(torch.tensor(loss_sum))
        gnorm = clip_grad(net, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step + 1, "loss": float(loss_t), "lr": opt.param_groups[0]["lr"],
               "grad_norm": float(gnorm), "tokens": total, "sec": round(time.time() - t0, 3)}
        validated = False
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            rec.update(eval_heldout(unwrap(net), tok, held, batch_size, device))
            if copy_mix:
                rec["copy_acc"] = copy_accuracy(unwrap(net), tok, device)
            if val:  # greedy, one episode per held-out task
                t1 = time.time()
                # each rank plays them on its own full replica; the mean keeps every rank's decision the same
                mine = torch.tensor(validate(unwrap(net), tok, *val), dtype=torch.float64)
                rec["val_success"] = float(all_reduce_sum(mine)) / n_ranks
                rec["val_s"] = round(time.time() - t1, 1)
                validated = rec["val_success"] > best["success"]
                best = ({"success": rec["val_success"], "step": step + 1, "since": 0} if validated
                        else {**best, "since": best["since"] + 1})
                rec["val_best_step"] = best["step"]
        if step == start:
            rec.update(warm)
        if rank == 0:
            shown = ({"eval": f"{rec['eval_loss']:.3f}", "id_acc": f"{rec['eval_id_acc']:.2f}"}
                     if "eval_loss" in rec else {})
            bar.set_postfix(loss=f"{rec['loss']:.3f}", **shown)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        stop = val is not None and best["since"] >= patience
        if validated:  # the best validated weights so far, kept apart from the rolling checkpoints
            save_checkpoint(os.path.join(out, "best"), step + 1, net, tok, extra={"finished": True})
        if (step + 1) % save_every == 0 or step + 1 == steps or stop:  # every rank: FSDP gathers the weights
            save_checkpoint(out, step + 1, net, tok, opt, extra={"best": best})
        if stop:
            break
    if val is not None and best["step"] and rank == 0:  # the run's model is its best validated checkpoint
        point_latest(out, os.path.join("best", open(os.path.join(out, "best", "latest")).read().strip()))
        print(f"sft.py: validation success peaked at {best['success']:.3f} at step {best['step']}: "
              f"{out}/latest names that checkpoint", flush=True)
        net, tok = load_model(out, **setup.load_kw)  # returned: the model the run folder now names
    if n_ranks > 1:
        leave_ranks()  # under torchrun the process ends here (see there why)
    return unwrap(net), tok


# ----------------------------------------------------------------------------------------------------
# the loss, the data and the schedule

def micro_loss(model, batch, total_tokens, device):
    """Sum of agent-token NLL in this micro-batch divided by the agent tokens of the whole global batch,
    so that gradient accumulation and ranks add up to a token-level mean. (A batch of (ids, all-ones mask)
    gives plain language-model loss on every token.)"""
    ids, lmask, attn = pad_batch(batch, 0, device)
    with autocast(device):
        lp = token_logprobs(model, ids, attn, chunk=LOGPROB_CHUNK)  # never the whole (B, T, V) logits
    return -(lp * lmask[:, 1:]).sum() / total_tokens

@torch.no_grad()
def eval_heldout(model, tok, data, batch_size, device):
    """One teacher-forced pass over held-out conversations -> {"eval_loss": agent-token NLL, "eval_acc": greedy
    accuracy on agent tokens, "eval_id_acc": the same on agent tokens holding a digit or a customer name}. The last
    is the copying meter: a model that only learned the protocol, not to copy ids and names, scores near 0 on it."""
    model.eval()
    names = set(NAME_TOKENS)
    copied = torch.tensor([any(ch.isdigit() for ch in t) or t in names
                           for t in tok.convert_ids_to_tokens(list(range(len(tok))))], device=device)
    nll, hit, n, dhit, dn = 0.0, 0, 0, 0, 0
    for i in range(0, len(data), batch_size):
        ids, lmask, attn = pad_batch(data[i:i + batch_size], 0, device)
        with autocast(device):
            lp, _, greedy = logprobs_chunked(model, ids, attn)  # (B, T-1) each; no (B, T, V) logits at once
        tgt, m = ids[:, 1:], lmask[:, 1:].bool()
        nll -= float((lp * m).sum())
        ok, d = greedy & m, copied[tgt] & m
        hit, n, dhit, dn = hit + int(ok.sum()), n + int(m.sum()), dhit + int((ok & d).sum()), dn + int(d.sum())
    model.train()
    return {"eval_loss": nll / max(1, n), "eval_acc": hit / max(1, n), "eval_id_acc": dhit / max(1, dn)}

def split_heldout(convs, n_eval):
    """Held out: the first n_eval conversations and every other conversation of their tasks, so that no validation
    task is trained on. -> (held-out conversations, training conversations, held-out task ids)."""
    key = lambda i, c: str(c.get("task_id", f"#{i}"))  # a conversation without a task id is its own task
    ids = {key(i, c) for i, c in enumerate(convs[:n_eval])}
    held = [c for i, c in enumerate(convs) if key(i, c) in ids]
    return held, [c for i, c in enumerate(convs) if key(i, c) not in ids], ids

def validation(data, held_ids):
    """The held-out conversations' tasks as a validation set on the training side, where synth.py's train_tasks.jsonl
    and shop.json sit beside `data` -> (world, tasks), else None (conversations from elsewhere: no validation)."""
    folder = os.path.dirname(os.path.abspath(data))
    tasks_path, db_path = os.path.join(folder, "train_tasks.jsonl"), os.path.join(folder, "shop.json")
    if not (os.path.isfile(tasks_path) and os.path.isfile(db_path)):
        print(f"sft.py: no train_tasks.jsonl and shop.json beside {data}: no validation, all --steps run", flush=True)
        return None
    tasks = [t for t in env.load_tasks(tasks_path) if str(t["id"]) in held_ids]
    return (env.Shop(env.load_db(db_path), max_turns=16), tasks) if tasks else None

@torch.no_grad()
def validate(model, tok, world, tasks, seed=0):
    """Greedy success rate on the validation tasks, one episode each with the scripted user, as evaluate.py plays
    them (64 new tokens a turn, 1024 an episode)."""
    agent = TokenAgent(HFGenerator(model, tok), tok, max_new_tokens=64, temperature=0.0, max_len=1024)
    eps = run_episodes(agent, world, tasks, seed=seed)
    for ep, task in zip(eps, tasks):
        world.score(ep, task)
    return sum(ep.reward for ep in eps) / len(eps)

def load_conversations(path):
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    c = json.loads(line)
                    assert isinstance(c.get("messages"), list), "no 'messages' list"
                except (json.JSONDecodeError, AssertionError) as e:
                    raise ValueError(f"{path}:{n}: not a conversation ({e})") from None
                out.append(c)
    return out

def lr_at(step, total, lr, warmup):
    """Linear warmup then cosine to 10% of the peak."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))



# ====================================================================================================
# The tiny model, for the CPU demo only: everything below is entered through tiny_model() and CopyMix.
# ====================================================================================================

@dataclass
class TinyConfig:
    vocab_size: int = 2048   # BPE tokens, plus one token per 2- and 3-digit string and per customer name
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    copy_warmup: int = 900   # at most this many short copy steps before SFT, then a third as many long ones

def tiny_model(convs, cfg, *, lr, seed, device, init_dir=None):
    """A tokenizer trained on the conversations, a fresh small Qwen3 sized to it (saved untrained to
    `init_dir`: the evaluation's "base" row), then the copy warm-up. -> (tokenizer, model, warm-up metrics)."""
    tok, model = make_tiny(convs, cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.n_head, seed)
    model.to(device)
    if init_dir:
        save_checkpoint(init_dir, 0, model, tok)
    warm = {}
    if cfg.copy_warmup:  # every rank runs the same seeded warm-up, so the replicas stay equal
        t0 = time.time()
        acc, short = copy_warmup(model, tok, cfg.copy_warmup, lr, device, seed)
        warm = {"copy_acc": acc, "copy_short_steps": short, "copy_warmup_s": round(time.time() - t0, 1)}
    return tok, model, warm

class CopyMix:
    """A few long copy sequences added to every SFT step, so that the copy circuit is not forgotten."""

    def __init__(self, tok, n, seed, device):
        self.tok, self.n, self.seed, self.device = tok, n, seed, device

    def loss(self, model, step, rank):
        # seeded by step and rank: a resumed run sees the same sequences
        rng = torch.Generator().manual_seed(self.seed * 1000003 + step * 101 + rank)
        return COPY_MIX_WEIGHT * copy_loss(model, self.tok, "long", rng, self.device, self.n)


# the tokenizer and the model: a byte-level BPE trained on the data, a compact ChatML template, a small Qwen3

TINY_CHAT_TEMPLATE = chatml_template()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
DIGIT_CHUNKS = [f"{i:03d}" for i in range(1000)] + [f"{i:02d}" for i in range(100)]
# the generated shop's customer names, one token each in both cases: "Olga" is then the same token after a space
# (a user message), a quote (a tool call's JSON) or a dot (an e-mail), so it can be copied token by token
NAME_TOKENS = sorted({w for n in env.FIRST + env.LAST for w in (n, n.lower())})

def build_tiny_tokenizer(texts, vocab_size=2048):
    """Byte-level BPE (`vocab_size` tokens) trained on `texts`, plus one token for every 2- and 3-digit string
    and for each name of the generated shop. Digit runs become 3-digit chunks (left to right: 1234567 -> 123 456
    7), so every id, seen in training or not, is the same few tokens wherever it appears (a user message, a JSON
    result, a tool call), and the model copies it chunk by chunk. (A BPE learned on the data would make the
    training users' ids single tokens, which a small model memorizes, and shatter unseen ids into pieces it never
    copied; and it splits " Olga" and '"Olga' differently.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    # no word-splitting regex: merges may cross spaces and punctuation, so a JSON key with its quotes
    # ('",Ġ"item_id":Ġ"') or a stock phrase ('IĠwillĠcancelĠorderĠ#W') becomes one token and a conversation is ~3x
    # shorter (1065 -> 350 tokens at 2048 merges); lines stay apart so a turn's tokens never depend on the next turn
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # train on the text between special tokens: without the regex a merge could otherwise swallow one
    # ('###STOP###<|im_end|>'), and a sampled token would then spell an end of turn that is not one
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tk.train_from_iterator((piece for t in texts for piece in special.split(t) if piece), trainer)
    # added tokens are matched before pre-tokenization, longest first: a digit run is cut into 3-digit chunks
    tk.add_tokens(DIGIT_CHUNKS + NAME_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=TINY_CHAT_TEMPLATE, model_max_length=4096)

def build_tiny_model(tok, d_model=128, n_layer=4, n_head=4, max_len=4096, seed=0):
    """A fresh small Qwen3 (the architecture of the GPU recipe, scaled down). ~1M parameters by default."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=d_model, intermediate_size=3 * d_model,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      head_dim=d_model // n_head, max_position_embeddings=max_len, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return Qwen3ForCausalLM(cfg)

def make_tiny(conversations, vocab_size, d_model, n_layer, n_head, seed):
    """Tokenizer trained on the rendered training conversations, then a fresh model sized to it."""
    boot = build_tiny_tokenizer((json.dumps(c["messages"]) for c in conversations), 512)  # only to render
    texts = [render(boot, c["messages"], c.get("tools")) for c in conversations]
    tok = build_tiny_tokenizer(texts, vocab_size)
    return tok, build_tiny_model(tok, d_model, n_layer, n_head, seed=seed)


# ----------------------------------------------------------------------------------------------------
# copying, taught first. Serving a customer means copying ids (orders, users, items, payment methods) across
# hundreds of tokens of conversation. That needs an induction circuit (find the earlier occurrence of the current
# token, copy what followed), and a model trained from scratch on the conversations alone sits on a long plateau
# before one forms. So the tiny model first learns to copy on synthetic sequences (random runs of digit-chunk and
# name tokens repeated after a random gap, inside "text" filler), short contexts then long ones (distances must
# vary, or it learns a fixed offset), and a few copy sequences stay in every SFT step so that the circuit is not
# forgotten. The short stage packs a long run (24 of 64 tokens) after a short gap: shorter runs left the plateau
# far later, or not at all.

COPY_MIX_WEIGHT = 0.5  # the copy loss's weight next to the SFT loss in each step
COPY_STAGES = {"short": (24, 64, 16, 32), "long": (16, 256, 200, 8)}  # run length, sequence length, max gap, batch
COPY_FORMED = 1.0  # short-stage copy loss (20-step mean) that says the circuit formed; the plateau sits at ~6.5
COPY_NAME_P = 0.2  # share of name tokens in copy runs (0: digits only never copied names; 0.5: no circuit by 1200)

@functools.lru_cache(maxsize=4)
def copy_token_ids(tok):
    """-> (digit-chunk ids, name ids): what copy runs are made of."""
    return torch.tensor(tok.convert_tokens_to_ids(DIGIT_CHUNKS)), torch.tensor(tok.convert_tokens_to_ids(NAME_TOKENS))

def copy_run(tok, run, rng):
    """`run` random tokens, each a digit chunk or (with probability COPY_NAME_P) a customer name."""
    chunks, names = copy_token_ids(tok)
    pick_name = torch.rand(run, generator=rng) < COPY_NAME_P
    return torch.where(pick_name, names[torch.randint(0, len(names), (run,), generator=rng)],
                       chunks[torch.randint(0, len(chunks), (run,), generator=rng)])

def copy_batch(tok, run, length, max_gap, n, rng):
    """n sequences of "text" filler, each with a random copy run repeated after a random gap.
    -> ids (n, length) and mask (n, length): 1 on the repeat's tokens after its first (what induction predicts)."""
    filler = torch.arange(len(SPECIAL_TOKENS) + 256, len(SPECIAL_TOKENS) + 356)  # 100 BPE merges: "text"
    ids = filler[torch.randint(0, len(filler), (n, length), generator=rng)]
    mask = torch.zeros(n, length, dtype=torch.long)
    for b in range(n):
        r = copy_run(tok, run, rng)
        gap = int(torch.randint(0, max_gap, (1,), generator=rng))
        a = int(torch.randint(0, length - 2 * run - gap + 1, (1,), generator=rng))
        c = a + run + gap
        ids[b, a:a + run], ids[b, c:c + run] = r, r
        mask[b, c + 1:c + run] = 1
    return ids, mask

def copy_loss(model, tok, stage, rng, device, n=None):
    """Mean NLL of the copied tokens in one batch of the stage ("short" or "long")."""
    run, length, max_gap, batch = COPY_STAGES[stage]
    ids, mask = (t.to(device) for t in copy_batch(tok, run, length, max_gap, n or batch, rng))
    with autocast(device):
        lp = token_logprobs(model, ids, torch.ones_like(ids))  # (n, length-1)
    return -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()

@torch.no_grad()
def copy_accuracy(model, tok, device, seed=0):
    """Greedy accuracy on copies in 512-token sequences with gaps up to 400: longer than anything trained on."""
    ids, mask = (t.to(device) for t in copy_batch(tok, 16, 512, 400, 8, torch.Generator().manual_seed(seed)))
    pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    return float(((pred == ids[:, 1:]) & mask[:, 1:].bool()).sum() / mask[:, 1:].sum())

def copy_warmup(model, tok, steps, lr, device, seed):
    """Copy-task steps with their own AdamW: the short stage until the induction circuit has formed (the mean copy
    loss of the last 20 steps below COPY_FORMED; at most `steps` steps), then steps // 3 long ones. When the circuit
    forms varies with the seed, hence this test instead of a fixed switch; a formed circuit can still fail to carry
    over to the long stage, so copy_acc is returned and logged. -> (copy accuracy, short-stage steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    rng = torch.Generator().manual_seed(seed)
    recent, short = [], steps  # short: where the long stage starts, moved earlier once the circuit has formed
    bar = tqdm(range(steps + steps // 3), desc="copy warm-up")
    for step in bar:
        stage = "short" if step < short else "long"
        loss = copy_loss(model, tok, stage, rng, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [float(loss.detach())])[-20:]
        if stage == "short" and len(recent) == 20 and sum(recent) / 20 < COPY_FORMED:
            short = step + 1
        if step + 1 == short + steps // 3:
            break
        bar.set_postfix(loss=f"{recent[-1]:.2f}", stage=stage)
    return copy_accuracy(model, tok, device), short


# ----------------------------------------------------------------------------------------------------
# the committed base (tests/tiny_base, made once by tests/pretrain_base.py) and its descendants

def is_tiny_family(tok):
    """True for this section's tokenizers (one token per customer name and per 2- and 3-digit string): the
    committed base, its descendants, --model tiny. Real chat models' tokenizers have neither."""
    vocab = tok.get_vocab()
    return all(t in vocab for t in NAME_TOKENS) and all(t in vocab for t in DIGIT_CHUNKS)


# ----------------------------------------------------------------------------------------------------
# re-drawing ids and names

ID_DIGITS = re.compile(r"\d{4,}")
NAMES = re.compile(r"(?<![A-Za-z])(" + "|".join(NAME_TOKENS) + r")(?![a-z])")  # a name, not inside a word

def redraw_ids(messages, rng, keys=False, unique=False):
    """Replace every run of 4+ digits (order, item, product, payment and user ids, zips) by a fresh random run of
    the same length, and every customer name by another (first names and last names each permuted), consistently
    across one conversation: "Olga", "olga.ito8993@..." and "olga_ito_8993" stay one person. The conversation
    stays self-consistent, but no id or name can be memorized: a small model trained on a few dozen users must
    learn to copy them from the context. keys: dict keys too; unique: no two runs get the same new digits (both
    for a whole database, whose records are keyed by id: tests/demo_study.py's validation shop)."""
    new, taken = {}, set()
    names = dict(zip(env.FIRST + env.LAST, rng.sample(env.FIRST, len(env.FIRST)) + rng.sample(env.LAST, len(env.LAST))))
    names.update({a.lower(): b.lower() for a, b in names.items()})

    def digits(m):
        s = m.group(0)
        draw = lambda: "".join(str(rng.randrange(10)) for _ in s)  # noqa: E731
        if s not in new:
            new[s] = draw()
            while unique and new[s] in taken:
                new[s] = draw()
            taken.add(new[s])
        return new[s]

    def walk(x):
        if isinstance(x, str):
            return NAMES.sub(lambda m: names[m.group(0)], ID_DIGITS.sub(digits, x))
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {walk(k) if keys else k: walk(v) for k, v in x.items()}
        return x
    return walk(messages)


if __name__ == "__main__":
    main()
