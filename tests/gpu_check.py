"""
tests/gpu_check.py: the prepared check for a machine with one GPU (pytest does not collect it; a test runs its
--cpu-smoke mode). It needs only torch (2.11 or later), transformers, peft and this repository: no vllm, no
network, no weights.

    python tests/gpu_check.py --template /path/to/qwen3.jinja       # one GPU: about 3-5 minutes, at most 8
    python tests/gpu_check.py --cpu-smoke --template ...            # the same code path, tiny, on a CPU (< 1 min)

For random-init Qwen3-0.6B and Qwen3-1.7B (their real shapes and Qwen3's 151,936-token vocabulary, so the
output layer costs what it will; rollout.QWEN3) in bf16, FSDP2 at world size 1 through setup_distributed's
real process group (cpu:gloo,cuda:nccl) and activation checkpointing, it measures:
- SFT steps (sft.micro_loss: chunked log-probs), tokens/s and peak GPU memory, next to the memory plan;
- GRPO steps (grpo.grpo_step) with the transformers sampler (HFGenerator + run_episodes, the scripted user, a
  few generated tasks): rollout tokens/s, update tokens/s and peak memory. A random model solves nothing, so
  the rewards are overwritten to alternate 1, 0 within each group: every step then updates;
- one bf16 forward+backward's peak memory over what was resident before it (torch.cuda.max_memory_allocated),
  against the memory plan's terms for it (gathered weights, gradients, activations, logits chunk), within 15%;
- a resume (first size): a checkpoint with the AdamW state, reloaded as sft.py and grpo.py do (memory-mapped,
  re-sharded), every state tensor equal;
- how far the trainer's bf16 log-probs (rollout.logprobs_chunked, one forward over the whole episode) are from
  the sampler's (bf16, one token at a time with a KV cache): max and mean absolute difference over sampled
  tokens, which is what GRPO's ratio sees at its first PPO step.
The tokenizer is the project's own tiny BPE (sft.build_tiny_tokenizer) trained on the generated conversations
rendered with the template given (Qwen3's); the model's embedding has 151,936 rows whatever its size.
Prints one markdown table.
"""
import argparse
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules

import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import env  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
import synth  # noqa: E402

SMOKE = {"smoke": rollout.Shapes(hidden=64, layers=2, intermediate=128, heads=2, kv_heads=1, head_dim=32,
                                 vocab=8192, tied=True)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("check")
    g.add_argument("--template", default=None, help="a chat template file (Qwen3's); default: the tiny ChatML")
    g.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: the code path, in < 1 minute")
    g.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"], help="rollout.QWEN3 sizes to check")
    g.add_argument("--sft-steps", type=int, default=6, help="SFT steps per size (the first is not timed)")
    g.add_argument("--grpo-steps", type=int, default=3, help="GRPO steps per size")
    g.add_argument("--sft-lr", type=float, default=5e-4,
                   help="high for a random model: a few steps teach it to end its turns, so rollouts have several")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    rank, world, device = start_one_rank()
    if device.startswith("cuda") and smoke:
        device = "cpu"  # the smoke run is the CPU's, even where a GPU exists
    data = make_data(smoke)
    tok, template = make_tokenizer(data["convs"], a.template)
    sizes = SMOKE if smoke else {k: rollout.QWEN3[k] for k in a.sizes}
    run = dict(sft_lr=a.sft_lr, sft_steps=2 if smoke else a.sft_steps, grpo_steps=1 if smoke else a.grpo_steps,
               batch=2 if smoke else 4, max_len=384 if smoke else 2048, group=2 if smoke else 4,
               tasks=2 if smoke else 4, turns=2 if smoke else 3, new_tokens=8 if smoke else 64)
    rows = []
    for k, (name, shapes) in enumerate(sizes.items()):
        t0 = time.time()
        rows += check_size(name, shapes, tok, data, device=device, resume=k == 0, **run)
        print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\nGPU check: {gpu_name(device)}, torch {torch.__version__}, template {template}, FSDP2 world size "
          f"{world}, bf16 {device.startswith('cuda')}, logits chunk {rollout.LOGPROB_CHUNK} rows\n")
    print("| model | check | tokens | tokens/s | peak GiB | memory plan GiB | result |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in ("model", "check", "tokens", "tok_s", "peak", "plan",
                                                             "result")) + " |")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return rows


def start_one_rank():
    """The process group exactly as torchrun gives it, with one rank: setup_distributed's own code path."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return rollout.setup_distributed()


def make_data(smoke):
    """A generated shop, tasks, and the oracle's conversations (SFT data)."""
    db = synth.generate_shop(0, n_users=20 if smoke else 60)
    tasks = synth.generate_tasks(db, 0, n_train=16 if smoke else 48, n_test=2)["train"]
    world = env.Shop(db)
    eps = rollout.run_episodes(rollout.TextAgents(synth.OracleAgent), world, tasks)
    for e, t in zip(eps, tasks):
        world.score(e, t, "db")
    convs = [{"messages": e.messages, "tools": env.TOOL_SCHEMAS} for e in eps if e.reward == 1.0]
    return {"db": db, "tasks": tasks, "convs": convs}


def make_tokenizer(convs, template_path):
    """The tiny BPE trained on the conversations as the template renders them, with that template (and, for
    Qwen3's, its think and tool-response tokens). rollout.py handles templates that rewrite history."""
    template, name = rollout.chatml_template(), "ChatML (tiny)"
    if template_path:
        template, name = Path(template_path).read_text(), Path(template_path).name
    boot = sft.build_tiny_tokenizer((json.dumps(c["messages"]) for c in convs), 512)
    boot.chat_template = template
    tok = sft.build_tiny_tokenizer([rollout.render(boot, c["messages"], c["tools"]) for c in convs], 2048)
    tok.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"], special_tokens=True)
    tok.chat_template = template
    rollout.encode_conversation(tok, convs[0]["messages"], convs[0]["tools"])  # fails loudly on a bad template
    return tok, name


def make_model(shapes, tok, device):
    """A random-init Qwen3 of these shapes, built directly on the device (fp32: the FSDP master weights), its
    vocabulary the full Qwen3 one; the tokenizer's ids are its first rows."""
    cfg = Qwen3Config(vocab_size=shapes.vocab, hidden_size=shapes.hidden, intermediate_size=shapes.intermediate,
                      num_hidden_layers=shapes.layers, num_attention_heads=shapes.heads,
                      num_key_value_heads=shapes.kv_heads, head_dim=shapes.head_dim, tie_word_embeddings=shapes.tied,
                      max_position_embeddings=40960, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg)


def check_size(name, shapes, tok, data, *, device, sft_lr, sft_steps, grpo_steps, batch, max_len, group, tasks, turns,
               new_tokens, resume=False):
    cuda = device.startswith("cuda")
    scale = rollout.ModelSetup(fsdp=True, activation_checkpointing=True, cpu_offload=False, lora_rank=0, lora_alpha=0.0,
                          bf16=cuda and torch.cuda.is_bf16_supported(), n_ranks=1, device=device)
    model = scale.prepare(make_model(shapes, tok, device))
    opt = torch.optim.AdamW(model.parameters(), lr=sft_lr, betas=(0.9, 0.99))
    plan = dict(n_ranks=1, fsdp=True, activation_checkpointing=True, bf16=scale.bf16)
    rows, label = [], f"Qwen3-{name}" if name != "smoke" else "tiny (smoke)"

    # 1. SFT steps: batch conversations of up to max_len tokens, the real loss
    seqs = [rollout.encode_conversation(tok, c["messages"], c["tools"]) for c in data["convs"]]
    seqs = [(i[:max_len], m[:max_len]) for i, m in seqs]
    reset_peak(device)
    tokens, secs = 0, 0.0
    for step in range(sft_steps):
        mb = [seqs[(step * batch + k) % len(seqs)] for k in range(batch)]
        t0 = sync(device)
        loss = sft.micro_loss(model, mb, max(1.0, float(sum(sum(m[1:]) for _, m in mb))), device)
        loss.backward()
        rollout.clip_grad(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0 or sft_steps == 1:  # the first step pays for allocations and kernel choices
            tokens, secs = tokens + sum(len(i) for i, _ in mb), secs + sync(device) - t0
    longest = max(len(i) for i, _ in seqs)
    dtype = "bf16" if scale.bf16 else "fp32"
    rows.append(fwd_bwd_memory(model, seqs[:batch], shapes, plan, device, label))
    if resume:  # the smallest size only: a checkpoint with AdamW state is 16 bytes a parameter on disk
        rows.append(resume_check(model, opt, tok, shapes, scale, device, label))
    rows.append({"model": label, "check": f"SFT step ({dtype} FSDP2, batch {batch} x <= {longest} tokens)",
                 "tokens": tokens, "tok_s": f"{tokens / max(secs, 1e-9):.0f}", "peak": peak(device),
                 "plan": gib(rollout.memory_plan(shapes, seq_len=longest, micro_batch=batch, **plan)["update"]
                             - rollout.OVERHEAD), "result": f"loss {float(loss.detach()):.3f}"})

    # 2. GRPO steps with the transformers sampler; rewards alternate so that every step updates
    for g in opt.param_groups:
        g["lr"] = 1e-6  # the paper's RL rate
    gen = rollout.HFGenerator(rollout.unwrap(model), tok)
    sampled = []

    class Alternating(env.Shop):  # rewards 1, 0, 1, 0, ... in the order episodes are scored
        def score(self, ep, task, basis="task"):
            ep.reward = float(len(sampled) % 2 == 0)
            sampled.append(ep)
    agent = rollout.TokenAgent(gen, tok, max_new_tokens=new_tokens, temperature=1.0, max_len=max_len)
    kw = dict(ranks=rollout.Ranks(0, 1, device), seed=0, batch_tasks=tasks, group=group, reward_basis="db",
              drop_zero_spread=False, mean_only=False,
              update_kw=dict(ppo_epochs=1, mini_batches=1, micro_batch=group, clip=0.2, beta=0.0, grad_clip=1.0,
                             temperature=1.0, seed=0))
    reset_peak(device)
    world = Alternating(data["db"], max_turns=turns)
    recs = [grpo.grpo_step(model, None, opt, agent, world, data["tasks"], step=s, **kw) for s in range(grpo_steps)]
    gen_tokens = sum(r["tokens_generated"] for r in recs)
    trained = sum(len(e.ids) for e in sampled)
    longest = max(len(e.ids) for e in sampled)
    rows.append({"model": label, "check": f"GRPO rollout (HFGenerator, {tasks} tasks x {group}, {turns} turns)",
                 "tokens": gen_tokens, "tok_s": f"{gen_tokens / sum(r['rollout_s'] for r in recs):.0f}",
                 "result": f"{sum(r['turns'] for r in recs) / len(recs):.1f} turns/episode"})
    rows.append({"model": label, "check": f"GRPO update (micro-batch {group} x <= {longest} tokens)",
                 "tokens": trained, "tok_s": f"{trained / max(1e-9, sum(r['update_s'] for r in recs)):.0f}",
                 "peak": peak(device), "plan": gib(rollout.memory_plan(shapes, seq_len=longest, micro_batch=group,
                                                                       **plan)["update"] - rollout.OVERHEAD),
                 "result": f"loss {recs[-1]['loss']:.4f}, grad norm {recs[-1]['grad_norm']:.3f}"})

    # 3. the sampler's log-probs against the trainer's: fresh episodes from the current weights, no update
    eps = rollout.run_episodes(agent, env.Shop(data["db"], max_turns=turns), data["tasks"][:tasks], seed=7)
    diffs = []
    with torch.no_grad():
        for e in eps:
            ids = torch.tensor([e.ids], device=device)
            with rollout.autocast(device):
                lp = rollout.logprobs_chunked(model, ids, torch.ones_like(ids))[0][0].float().cpu()
            m = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
            diffs.append((lp[m] - torch.tensor(e.logprobs[1:])[m]).abs())
    d = torch.cat(diffs)
    rows.append({"model": label, "check": "sampler vs trainer log-probs (same weights)", "tokens": d.numel(),
                 "result": f"max abs diff {float(d.max()):.4f}, mean {float(d.mean()):.5f}"})
    del model, opt, gen
    if cuda:
        torch.cuda.empty_cache()
    return rows


def fwd_bwd_memory(model, mb, shapes, plan, device, label):
    """One bf16 forward+backward of a micro-batch: the memory it adds at its peak (torch.cuda.max_memory_allocated
    over what was allocated before: weights and AdamW state are already there) against the plan's terms for the
    same tokens (gathered weights, gradients, activations, the logits chunk), within 15%."""
    model.zero_grad(set_to_none=True)
    sync(device)
    before = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    reset_peak(device)
    sft.micro_loss(model, mb, 1.0, device).backward()
    sync(device)
    T = max(len(i) for i, _ in mb)
    p = rollout.memory_plan(shapes, seq_len=T, micro_batch=len(mb), **plan)
    want = p["gathered"] + p["grads"] + p["activations"] + p["logits"]
    row = {"model": label, "check": f"forward+backward peak over resident ({len(mb)} x <= {T} tokens)",
           "tokens": len(mb) * T, "plan": gib(want)}
    if device.startswith("cuda"):
        got = torch.cuda.max_memory_allocated() - before
        ratio = got / want
        row.update(peak=gib(got), result=f"measured / plan {ratio:.2f}: {'within' if abs(ratio - 1) < 0.15 else 'OFF'}"
                                         " 15%")
    else:
        row.update(peak=peak(device), result="not measured on a CPU (resident size is not allocator memory)")
    model.zero_grad(set_to_none=True)
    return row


def resume_check(model, opt, tok, shapes, scale, device, label):
    """Save a checkpoint with the AdamW state, then resume it as sft.py and grpo.py do (a fresh model from the
    checkpoint, prepared, its optimizer state from the memory-mapped train_state.pt): every state tensor equal."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rollout.save_checkpoint(d, 1, model, tok, opt)
        again, _ = rollout.load_model(d, **scale.load_kw)
        again = scale.prepare(again)
        opt2 = torch.optim.AdamW(again.parameters(), lr=opt.param_groups[0]["lr"], betas=(0.9, 0.99))
        rollout.load_optimizer_state(again, opt2, rollout.load_train_state(d)["optimizer"])
        a, b = rollout.optimizer_state(model, opt), rollout.optimizer_state(again, opt2)
        diff = max(float((rollout._whole(x[k]).float() - rollout._whole(b["state"][n][k]).float()).abs().max())
                   for n, x in a["state"].items() for k in ("exp_avg", "exp_avg_sq"))
        n_states = len(a["state"])
        del again, opt2
    return {"model": label, "check": "resume: checkpoint with AdamW state, reloaded and re-sharded",
            "tokens": "", "result": f"{n_states} parameters' AdamW states, max abs diff {diff:.2e}"}


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.time()


def reset_peak(device):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak(device):
    """Peak GPU memory allocated since reset_peak; on a CPU the process's largest resident size so far."""
    if device.startswith("cuda"):
        return gib(torch.cuda.max_memory_allocated())
    return gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) + " (RSS)"


def gib(n):
    return f"{n / 2 ** 30:.2f}"


def gpu_name(device):
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"


if __name__ == "__main__":
    main()
