#!/usr/bin/env python3
"""Time to first token of a multi-turn chat, with the KV cache's prefix reuse and without.

Design
------
* One conversation, fixed for the whole run: a long system prompt (--system-tokens, ~500 tokens
  of English-like text) and --turns user messages (--user-tokens each), all generated from a
  seeded word list and cut to the wanted length as the model's own tokenizer counts it. Each
  reply is --reply-tokens greedy tokens (stopping early only at EOS); the assistant message put
  back into the history is the reply decoded to text (skip_special_tokens), as a chat client
  would store it, so the next prompt is the chat template re-rendered and re-tokenized — the
  reply's text need not re-tokenize to the ids that were generated, and the tokens the cache
  can reuse are exactly what matches (the "reply kept" column says how much of the reply did).
* Two Model instances of the same directory in this process: "reuse" plays the conversation
  with generate(reuse_prefix=True), "full" with reuse_prefix=False (a full prefill each turn;
  checked: m.stats["reused_tokens"] == 0). Both use the same OpenMP pool, one at a time. A new
  conversation (turn 1, every repetition) starts with reuse_prefix=False on both, so turn 1 is
  a cold prefill in both and turns 2.. hold what the previous turn of the same repetition left.
* The history is fixed by a warm-up pass (untimed; it also reads the weights into the page
  cache): the replies of the full-prefill instance. Every measured turn of both instances gets
  the same messages, so a reply that differed would not change the next prompt.
* TTFT = wall time from the request (apply_chat_template on the messages, then generate) to the
  first token id out of the generator: template rendering + tokenization + prefill + the first
  pick. The rest of the reply is then consumed (it fills the KV cache for the next turn).
  Within each turn the two modes alternate which goes first (reuse first on even repetitions).
* Check: the reply ids of every turn of every repetition (warm-up included) must be identical
  with and without reuse (greedy; the engine's logits do not depend on how a prompt is split
  into runs). A mismatch is printed loudly, recorded in the JSON and makes the exit status 1.
* Reported per turn: prompt tokens, tokens reused / prefilled with reuse (the full run prefills
  all), median (min–max) TTFT over --repeat repetitions for both modes, their ratio (of the
  medians, and the median (min–max) of the per-repetition ratios: the two runs of a pair are
  seconds apart, so a busy neighbour on a shared host hits both less unevenly), and the median
  template + tokenize time (part of both TTFTs). The footer gives the process's CPU time per
  wall second up to the first token (about --threads when nothing else wanted the cores).
* A random-weight model's greedy reply is rarely the tokenizer's own segmentation of its text
  (mixtral-mini: "gmhw"+"db" re-tokenizes as "gm"+"hw"+"db"), so there the reuse stops at the
  reply's first token and the whole reply is prefilled again. A trained model's greedy output is
  mostly the canonical segmentation, so "reply kept" should come closer to its maximum there
  (reply tokens - 1: the last token is yielded without being run) — not measured here.

    python tools/bench_chat.py --model-dir DIR [--threads 2] [--turns 4] [--repeat 5]
        [--system-tokens 500] [--user-tokens 60] [--reply-tokens 32] [--json [PATH]]
    python tools/bench_chat.py --write-template DIR   # a tokenizer_config.json with the Mixtral
        # [INST] template, for: python -m colibri tokenizer --model-dir MODEL --from DIR

--json alone prints one JSON object instead of the table; --json PATH writes it to PATH too.
The model directory needs a tokenizer and a chat template that accepts a system message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import colibri

# Mixtral-8x7B-Instruct-v0.1's chat template (its tokenizer_config.json since the 2024 revision
# that added the optional system message, which goes into the first [INST] block). With it the
# system prompt is at the front of every prompt, so every turn starts with the previous one.
MIXTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

WORDS = (
    "the of and to in is you that it for on with as are be this was have or at not your from "
    "can by all an they we more one will do if about which there so what their when up out has "
    "use other time many these some would make like him into them see number way could people "
    "than first water been called who oil its now find long down day did get come made may part "
    "answer question always never help user request clear short precise example detail careful "
    "explain step reason source code function value result error message system model token "
    "context memory cache prompt reply language polite honest safe helpful assistant follow rule "
    "format list table summary topic task review check test write read keep avoid include "
    "instead because however although unless before after during while each every both either "
    "simple complex small large quick slow early late good better best important useful"
).split()


def make_text(count, target, rng, opening=""):
    """Words drawn from WORDS into sentences, as many as make `target` tokens by `count`."""
    words = opening.split()
    sentences = []
    while True:
        n = int(rng.integers(8, 17))
        s = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), n)]
        s[0] = s[0].capitalize()
        sentences.append(" ".join(s) + ".")
        text = " ".join(words + sentences)
        if count(text) >= target:
            break
    words = text.split()
    lo, hi = 1, len(words)  # the fewest words that reach the target
    while lo < hi:
        mid = (lo + hi) // 2
        if count(" ".join(words[:mid])) >= target:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def conversation(model, system_tokens, user_tokens, turns, seed=0):
    rng = np.random.default_rng(seed)

    def count(t):
        return len(model.encode(t, add_special_tokens=False))

    system = make_text(count, system_tokens, rng, opening="You are a careful and helpful assistant.")
    users = [make_text(count, user_tokens, rng) for _ in range(turns)]
    return system, users


def messages_for(system, users, replies, turn):
    """The messages of request `turn` (0-based): system, then user/assistant pairs, then the user."""
    out = [{"role": "system", "content": system}]
    for i in range(turn):
        out += [{"role": "user", "content": users[i]}, {"role": "assistant", "content": replies[i]}]
    return out + [{"role": "user", "content": users[turn]}]


GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


def request(model, messages, reply_tokens, reuse):
    """One chat request: (ids of the reply, dict of timings and token counts)."""
    c0, t0 = time.process_time(), time.perf_counter()
    ids = model.apply_chat_template(messages, add_generation_prompt=True)
    t1 = time.perf_counter()
    gen = model.generate(ids, reply_tokens, reuse_prefix=reuse, **GREEDY)
    first = next(gen)
    t2, c2 = time.perf_counter(), time.process_time()
    reply = [first] + list(gen)
    t3 = time.perf_counter()
    st = model.stats
    return reply, {
        "prompt_tokens": len(ids),
        "reused_tokens": int(st["reused_tokens"]),
        "prefill_tokens": int(st["prefill_tokens"]),
        "template_s": t1 - t0,
        "ttft_s": t2 - t0,
        "prefill_s": float(st["prefill_seconds"]),
        "total_s": t3 - t0,
        "reply_tokens": len(reply),
        "cpu_per_wall": (c2 - c0) / (t2 - t0),
    }


def loud(msg):
    bar = "!" * 78
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", file=sys.stderr, flush=True)


def med(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt_ms(s):
    m = s["median"] * 1e3, s["min"] * 1e3, s["max"] * 1e3
    return f"{m[0]:.0f} ({m[1]:.0f}–{m[2]:.0f})" if m[0] >= 100 else f"{m[0]:.1f} ({m[1]:.1f}–{m[2]:.1f})"


def run(args):
    log = lambda *a: print("[bench_chat]", *a, file=sys.stderr, flush=True)  # noqa: E731
    t = time.perf_counter()
    models = {
        "reuse": colibri.load(args.model_dir, threads=args.threads),
        "full": colibri.load(args.model_dir, threads=args.threads),
    }
    log(f"loaded 2 x {models['full']!r} in {time.perf_counter() - t:.1f} s, {args.threads} threads")
    ref = models["full"]
    system, users = conversation(ref, args.system_tokens, args.user_tokens, args.turns, args.seed)
    mismatches = []

    def compare(rep, turn, a, b):
        if a != b:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"repetition": rep, "turn": turn + 1, "first_difference": k, "reuse": a, "full": b})
            loud(
                f"OUTPUT MISMATCH: turn {turn + 1}, repetition {rep}: the reply with prefix reuse differs "
                f"from the full prefill's at token {k}: {a[k : k + 8]} vs {b[k : k + 8]}"
            )

    # warm-up: fixes the history (the full prefill's replies) and reads the weights in
    replies, texts = {"reuse": [], "full": []}, []
    for turn in range(args.turns):
        msgs = messages_for(system, users, texts, turn)
        for mode in ("full", "reuse"):
            reply, _ = request(models[mode], msgs, args.reply_tokens, reuse=(mode == "reuse" and turn > 0))
            replies[mode].append(reply)
        compare("warm-up", turn, replies["reuse"][turn], replies["full"][turn])
        texts.append(ref.tokenizer.decode(replies["full"][turn], skip_special_tokens=True))
    log(
        f"warm-up done: system prompt {len(ref.encode(system, add_special_tokens=False))} tokens, "
        f"user messages {[len(ref.encode(u, add_special_tokens=False)) for u in users]} tokens, replies "
        f"{[len(r) for r in replies['full']]} tokens"
    )

    records = {mode: [[] for _ in range(args.turns)] for mode in models}
    for rep in range(args.repeat):
        order = ("reuse", "full") if rep % 2 == 0 else ("full", "reuse")
        for turn in range(args.turns):
            msgs = messages_for(system, users, texts, turn)
            got = {}
            for mode in order:
                reuse = mode == "reuse" and turn > 0
                got[mode], rec = request(models[mode], msgs, args.reply_tokens, reuse)
                if not reuse and rec["reused_tokens"] != 0:
                    raise SystemExit(
                        f"bench_chat: a reuse_prefix=False request reused {rec['reused_tokens']} "
                        f"tokens (turn {turn + 1}): the full-prefill figures would be wrong"
                    )
                if rec["reused_tokens"] + rec["prefill_tokens"] != rec["prompt_tokens"]:
                    raise SystemExit(f"bench_chat: reused + prefilled != prompt tokens: {rec}")
                records[mode][turn].append(rec)
            compare(rep, turn, got["reuse"], got["full"])
            if got["full"] != replies["full"][turn]:
                loud(
                    f"NON-DETERMINISTIC: turn {turn + 1}, repetition {rep}: the full prefill's reply differs "
                    f"from the warm-up's"
                )
                mismatches.append({"repetition": rep, "turn": turn + 1, "nondeterministic": True})
        log(
            f"repetition {rep + 1}/{args.repeat} (load {os.getloadavg()[0]:.2f}): TTFT ms reuse "
            f"{[round(records['reuse'][k][-1]['ttft_s'] * 1e3) for k in range(args.turns)]}, full "
            f"{[round(records['full'][k][-1]['ttft_s'] * 1e3) for k in range(args.turns)]}"
        )

    turns = []
    for turn in range(args.turns):
        r, f = records["reuse"][turn], records["full"][turn]
        prev_len = r[0]["prompt_tokens"] if turn == 0 else records["full"][turn - 1][0]["prompt_tokens"]
        reused = sorted({x["reused_tokens"] for x in r})
        row = {
            "turn": turn + 1,
            "prompt_tokens": r[0]["prompt_tokens"],
            "reused_tokens": reused[0] if len(reused) == 1 else reused,
            "prefill_tokens_reuse": r[0]["prompt_tokens"] - reused[0],
            "prefill_tokens_full": f[0]["prefill_tokens"],
            # of the previous turn's reply ids (which the cache holds, all but the last), how
            # many were still a prefix match after the text round trip
            "reply_tokens_kept": None if turn == 0 else max(0, reused[0] - prev_len),
            "previous_reply_tokens": None if turn == 0 else len(replies["full"][turn - 1]),
            "ttft_reuse_s": med([x["ttft_s"] for x in r]),
            "ttft_full_s": med([x["ttft_s"] for x in f]),
            "prefill_reuse_s": med([x["prefill_s"] for x in r]),
            "prefill_full_s": med([x["prefill_s"] for x in f]),
            "template_s": med([x["template_s"] for x in r + f]),
            "cpu_per_wall_reuse": med([x["cpu_per_wall"] for x in r]),
            "cpu_per_wall_full": med([x["cpu_per_wall"] for x in f]),
            "ttft_reuse_all_s": [x["ttft_s"] for x in r],
            "ttft_full_all_s": [x["ttft_s"] for x in f],
        }
        row["ratio"] = row["ttft_full_s"]["median"] / row["ttft_reuse_s"]["median"]
        # the two modes of one turn of one repetition ran seconds apart: their ratio sees the
        # same neighbours on this shared host
        row["ratio_paired"] = med([b["ttft_s"] / a["ttft_s"] for a, b in zip(r, f)])
        turns.append(row)
    m = models["full"]
    result = {
        "model_dir": os.path.abspath(args.model_dir),
        "model": repr(m),
        "weight_dtype": m.weight_dtype,
        "threads": args.threads,
        "repeat": args.repeat,
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "reply_tokens": args.reply_tokens,
        "seed": args.seed,
        "cpu": platform.processor() or platform.machine(),
        "colibri_version": getattr(colibri, "__version__", None),
        "outputs_match": not mismatches,
        "mismatches": mismatches,
        "per_turn": turns,
    }
    for mm in models.values():
        mm.close()
    return result


def table(res):
    lines = [
        f"{res['model']}, {res['threads']} threads, {res['repeat']} repetitions, replies of "
        f"{res['reply_tokens']} greedy tokens; TTFT ms median (min–max); turn 1 starts the conversation: "
        f"a full prefill in both",
        "",
        "| turn | prompt tokens | reused | prefilled (reuse) | reply kept | TTFT reuse | TTFT full prefill "
        "| full / reuse (medians) | paired | template+tokenize |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in res["per_turn"]:
        kept = "—" if t["turn"] == 1 else f"{t['reply_tokens_kept']}/{t['previous_reply_tokens']}"
        reuse = fmt_ms(t["ttft_reuse_s"]) + (" (cold)" if t["turn"] == 1 else "")
        ratio = "—" if t["turn"] == 1 else f"{t['ratio']:.1f}×"
        p = t["ratio_paired"]
        paired = "—" if t["turn"] == 1 else f"{p['median']:.1f}× ({p['min']:.1f}–{p['max']:.1f})"
        lines.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['reused_tokens']} | {t['prefill_tokens_reuse']} "
            f"| {kept} | {reuse} | {fmt_ms(t['ttft_full_s'])} | {ratio} | {paired} "
            f"| {t['template_s']['median'] * 1e3:.1f} |"
        )
    lines.append("")
    cw = [t[k]["median"] for t in res["per_turn"] for k in ("cpu_per_wall_reuse", "cpu_per_wall_full")]
    lines.append(
        f"process CPU time / wall time up to the first token, per-turn medians: {min(cw):.2f}–{max(cw):.2f} "
        f"({res['threads']:.0f} = every thread had a core throughout)"
    )
    lines.append(
        "outputs identical with and without reuse: "
        + ("yes" if res["outputs_match"] else f"NO ({len(res['mismatches'])} mismatches)")
    )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="a Colibri model directory with a tokenizer and a chat template")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4, help="user turns; TTFT is compared from turn 2 on")
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--user-tokens", type=int, default=60)
    ap.add_argument("--reply-tokens", type=int, default=32, help="greedy tokens per reply (fewer at EOS)")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions of the conversation; medians over them")
    ap.add_argument("--seed", type=int, default=0, help="of the conversation's text")
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="alone: print one JSON object instead of the table; with PATH: also write it there",
    )
    ap.add_argument(
        "--write-template",
        metavar="DIR",
        help="write DIR/tokenizer_config.json with the Mixtral [INST] template and exit",
    )
    args = ap.parse_args(argv)
    if args.write_template:
        os.makedirs(args.write_template, exist_ok=True)
        path = os.path.join(args.write_template, "tokenizer_config.json")
        with open(path, "w") as f:
            json.dump({"chat_template": MIXTRAL_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}, f, indent=2)
        print(path)
        return 0
    if not args.model_dir:
        ap.error("--model-dir is required")
    if args.turns < 2 or args.repeat < 1 or args.reply_tokens < 1:
        ap.error("need --turns >= 2, --repeat >= 1, --reply-tokens >= 1")
    res = run(args)
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.json == "-":
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
    return 0 if res["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
