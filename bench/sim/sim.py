#!/usr/bin/env python3
"""bench/sim: a cost-model simulator of pdmesh's prefill methods (TTFT prediction).

Predicts the time to first token of one prompt prefilled by R ranks with the methods of
prefill_node/ -- single, tsp, kvr-e, kvr-s, cp-kv (pass-KV), cp-q (pass-Q) -- for
R = 1..64 and 1K..1M tokens, and sets the predictions beside
  - pdmesh's own measurements (docs/perf/prefill.json from bench/prefill/run.py, R = 2),
  - KV-Runahead (Cho et al., ICML 2024; /work/shared/seeds/kv-runahead.md): TSP vs KVR-S on a
    Llama-7B shape (App. A Table 1, App. B Table 3) and the lower bound TTFT*(p) (eq. 1-3),
  - Context Parallelism (arXiv 2411.01783; /work/shared/seeds/context-parallelism.md): pass-KV vs
    pass-Q on Llama3-405B, 128K, CP4 (Table 4), and the full-prefill scaling numbers (Fig. 6, 8).

Model (the same for every method; see docs/perf/sim.md for the full list of assumptions):
  - compute time = FLOPs / rate, with one rate for the linear part (Q/K/V/O projections and
    the FFN, 2 FLOP per multiply-add per token; the FLOP count of `pdmesh calibrate`) and one
    for attention (4 * head_dim FLOP per query-key pair per head; by default only causal pairs,
    as our flash attention skips masked keys; "dense" counts the masked rectangle, like the
    eager kernels of the KV-Runahead paper);
  - a message costs latency + bytes / bandwidth; it starts when both the send and the receive
    are posted (rendezvous: every pattern of kvtransfer/group.c posts its receives first) and
    the sender's egress and the receiver's ingress are free (per-rank full-duplex links, one
    transfer at a time per direction);
  - collectives (TSP all-gather, pass-Q All2All: direct sends to every other rank) finish for
    rank i at max(posts) + latency + max(max_j egress bytes_j, ingress bytes_i) / bandwidth;
  - the simulation is an event timeline per layer and rank that follows the method files
    of prefill_node/ (tsp.c, kvr.c, ring_pass_kv.c, ring_pass_q.c) step by step
    (which waits precede which computation, which sends are asynchronous); attention work per
    block is an exact closed-form count of query-key pairs (no per-token loops).

Usage: python3 bench/sim/sim.py [--quick] [--self-test] [--calibration FILE] [--measured FILE]
Writes docs/perf/sim.json, docs/perf/sim.md and (with gnuplot) docs/perf/sim.png.
Python 3 standard library only.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- Models --------------------------------------------------------------------------------

MODELS = {
    # name: layers, d_model, n_ff, NH, NKV, head_dim, n_vocab
    "smollm2-135m": dict(title="SmolLM2-135M", layers=30, d=576, ff=1536, nh=9, nkv=3, hd=64,
                         vocab=49152),
    "llama3-8b": dict(title="Llama-3-8B", layers=32, d=4096, ff=14336, nh=32, nkv=8, hd=128,
                      vocab=128256),
    "llama3-405b": dict(title="Llama-3-405B", layers=126, d=16384, ff=53248, nh=128, nkv=8,
                        hd=128, vocab=128256),
    # The KV-Runahead paper's Llama 7B (MHA: 32 KV heads), for its comparisons.
    "llama-7b": dict(title="Llama-7B", layers=32, d=4096, ff=11008, nh=32, nkv=32, hd=128,
                     vocab=32000),
}

METHODS = ["single", "tsp", "kvr-e", "kvr-s", "cp-kv", "cp-q"]
MULTI = ["tsp", "kvr-e", "kvr-s", "cp-kv", "cp-q"]


def linear_flops_per_token(m):
    """Per layer: Q, K, V, O projections and the gated FFN, 2 FLOP per multiply-add (the count
    of `pdmesh calibrate`, cli/prefill_cmds.c prefill_flops)."""
    qkv = 2 * (m["d"] * m["nh"] * m["hd"] + 2 * m["d"] * m["nkv"] * m["hd"])
    out_ffn = 2 * (m["d"] * m["nh"] * m["hd"] + 3 * m["d"] * m["ff"])
    return qkv, out_ffn


def prefill_flops(m, n):
    """Total FLOPs of a single-rank prefill of n tokens, exactly as `pdmesh calibrate` counts
    them (projections + causal attention n(n+1)/2 pairs; no logits)."""
    qkv, out_ffn = linear_flops_per_token(m)
    return m["layers"] * ((qkv + out_ffn) * n + 4 * m["hd"] * m["nh"] * n * (n + 1) / 2)


# ---- Hardware ------------------------------------------------------------------------------


class Hw:
    """Rates and link of one rank.  lin / attn: FLOP/s; bw: bytes/s per direction per rank;
    lat: seconds per message; overhead: fixed seconds per prefill; mask: 'causal' (pdmesh's
    flash attention skips masked keys) or 'dense' (the masked rectangle is computed); wire:
    'pdmesh' (Q and partial outputs in f32, as ring_pass_q.c sends them) or 'paper' (bf16 Q/O);
    kv_bytes: bytes per KV element on the wire (f16 = 2)."""

    def __init__(self, name, lin, attn, bw, lat, overhead=0.0, mask="causal", wire="pdmesh",
                 kv_bytes=2, note=""):
        self.name, self.lin, self.attn, self.bw, self.lat = name, lin, attn, bw, lat
        self.overhead, self.mask, self.wire, self.kv_bytes, self.note = (overhead, mask, wire,
                                                                         kv_bytes, note)

    def but(self, **kw):
        d = dict(self.__dict__)
        d.update(kw)
        return Hw(**d)

    def to_json(self):
        return dict(self.__dict__)


GB = 1e9
# Context Parallelism paper, §4.1 and App. A: one CP rank = one 8xH100 host running TP8; the
# paper reports 502 TFLOP/s achieved per GPU (App. A), GTT = 400 Gb/s RDMA per GPU, GTI = 100
# Gb/s TCP/IP per GPU; one CP ring per KV head, so a host's 8 NICs carry the KV in parallel.
PRESETS = {
    "h100-rdma": Hw("h100-rdma", 8 * 502e12, 8 * 502e12, 8 * 50 * GB, 10e-6, wire="paper",
                    note="one CP rank = one 8xH100 node (TP8): 8 x 502 TFLOP/s achieved (CP "
                    "paper App. A), 8 x 50 GB/s RDMA (GTT, 400 Gb/s per GPU), 10 us latency"),
    "h100-tcp": Hw("h100-tcp", 8 * 502e12, 8 * 502e12, 8 * 12.5 * GB, 50e-6, wire="paper",
                   note="as h100-rdma but 8 x 12.5 GB/s TCP/IP front-end (GTI, 100 Gb/s per "
                   "GPU), 50 us latency"),
}

# KV-Runahead App. B Table 3, column "base 1 GPU": single-A100 TTFT of Llama 7B (HF eager
# attention, FP16) at 1k..12k tokens.  Used only to fit an A100 preset (see fit_a100()).
KVR_TABLE3_1GPU = {1024: 0.10, 2048: 0.24, 4096: 0.65, 8192: 1.95, 12288: 3.95}


def fit_a100():
    """Least-squares fit of TTFT(C) = c0 + a*C + b*C^2 to the paper's own single-GPU column
    (App. B Table 3), then a -> linear rate, b -> attention rate with dense C*C pairs (the
    paper's kernels compute the masked rectangle, §4.1), c0 -> fixed overhead."""
    xs = sorted(KVR_TABLE3_1GPU)
    # normal equations for [1, C, C^2]
    S = [[0.0] * 3 for _ in range(3)]
    v = [0.0] * 3
    for c in xs:
        row = [1.0, c / 1e3, (c / 1e3) ** 2]
        for i in range(3):
            v[i] += row[i] * KVR_TABLE3_1GPU[c]
            for j in range(3):
                S[i][j] += row[i] * row[j]
    c0, a, b = solve3(S, v)
    m = MODELS["llama-7b"]
    qkv, out_ffn = linear_flops_per_token(m)
    lin = m["layers"] * (qkv + out_ffn) * 1e3 / a
    attn = m["layers"] * 4 * m["hd"] * m["nh"] * 1e6 / b
    return dict(c0=c0, a=a, b=b, lin=lin, attn=attn)


def solve3(A, v):
    M = [row[:] + [v[i]] for i, row in enumerate(A)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(M[r][c]))
        M[c], M[p] = M[p], M[c]
        for r in range(3):
            if r != c:
                f = M[r][c] / M[c][c]
                for k in range(c, 4):
                    M[r][k] -= f * M[c][k]
    return [M[i][3] / M[i][i] for i in range(3)]


# ---- Exact counts ----------------------------------------------------------------------------


def causal_pairs(a, b, c, d):
    """Query-key pairs (q, k) with a <= q < b, c <= k < d and k <= q (closed form)."""
    if b <= a or d <= c:
        return 0
    tot = 0
    lo, hi = max(a, c), min(b, d)
    if hi > lo:
        n = hi - lo
        tot += n * (lo - c + 1) + n * (n - 1) // 2
    lo2 = max(a, d)
    if b > lo2:
        tot += (b - lo2) * (d - c)
    return tot


def dense_pairs(a, b, c, d):
    """Pairs a masked dense kernel computes: the whole rectangle unless every key is masked."""
    if b <= a or d <= c or c >= b:
        return 0
    return (b - a) * (d - c)


def split_even(n, r):
    """pdm_prefill_split_even: n // r each, the remainder to the last ranks."""
    return [n // r + (1 if i >= r - n % r else 0) for i in range(r)]


# ---- Cost of one rank's steps ---------------------------------------------------------------


class Cost:
    def __init__(self, m, hw):
        self.m, self.hw = m, hw
        self.L = m["layers"]
        qkv, out_ffn = linear_flops_per_token(m)
        self.s_qkv = qkv / hw.lin  # seconds per token
        self.s_ffn = out_ffn / hw.lin
        self.s_pair = 4 * m["hd"] * m["nh"] / hw.attn
        self.s_merge = 3 * m["nh"] * m["hd"] / hw.lin  # per query row merged (lse rescale + add)
        self.t_logits = 2 * m["d"] * m["vocab"] / hw.lin
        self.kv_tok = 2 * m["nkv"] * m["hd"] * hw.kv_bytes  # K and V bytes per token per layer
        if hw.wire == "pdmesh":  # ring_pass_q.c: f32 Q rows + int32 positions; f32 O + f32 lse
            self.q_tok = m["nh"] * m["hd"] * 4 + 4
            self.o_tok = m["nh"] * (m["hd"] + 1) * 4
        else:  # the paper's bf16 activations (lse kept in f32)
            self.q_tok = m["nh"] * m["hd"] * 2 + 4
            self.o_tok = m["nh"] * m["hd"] * 2 + m["nh"] * 4
        self.pairs = causal_pairs if hw.mask == "causal" else dense_pairs

    def msg(self, nbytes):
        return self.hw.lat + nbytes / self.hw.bw


# ---- Methods -------------------------------------------------------------------------------


def result(ttft, sent, wait, extra=None):
    r = {"ttft": ttft, "bytes_sent": sent, "wait": wait}
    if extra:
        r.update(extra)
    return r


def sim_single(cost, T, P=0):
    """pdm_model_prefill: chunked prefill on one rank; same FLOPs as one big chunk."""
    per_layer = (T * (cost.s_qkv + cost.s_ffn) + cost.pairs(P, P + T, 0, P + T) * cost.s_pair)
    return result(cost.hw.overhead + cost.L * per_layer + cost.t_logits, [0], [0.0])


def sim_tsp(cost, C, R):
    """pdm__run_tsp: even split; per layer QKV, all-gather of K/V (direct sends to all), causal
    attention of own rows against [0, C), projection + FFN; logits on the last rank."""
    if R == 1:
        return sim_single(cost, C)
    ch = split_even(C, R)
    begin = [sum(ch[:i]) for i in range(R)]
    q = [c * cost.s_qkv for c in ch]
    w = [cost.pairs(begin[i], begin[i] + ch[i], 0, C) * cost.s_pair + ch[i] * cost.s_ffn
         for i in range(R)]
    out = [(R - 1) * ch[i] * cost.kv_tok for i in range(R)]
    inb = [(C - ch[i]) * cost.kv_tok for i in range(R)]
    max_out = max(out)
    done_rel = [cost.hw.lat + max(max_out, inb[i]) / cost.hw.bw for i in range(R)]
    t = [cost.hw.overhead] * R
    wait = [0.0] * R
    for _ in range(cost.L):
        post = [t[i] + q[i] for i in range(R)]
        t0 = max(post)
        for i in range(R):
            d = t0 + done_rel[i]
            wait[i] += d - post[i]
            t[i] = d + w[i]
    t[R - 1] += cost.t_logits
    return result(max(t), [cost.L * o for o in out], wait)


class KvrChain:
    """pdm__run_kvr, simulated rank by rank (rank i depends only on rank i-1's send times), so
    that a partition search can re-simulate only the ranks after a changed boundary."""

    extrapolate = True

    def __init__(self, cost, C, R, P=0):
        self.cost, self.C, self.R, self.P = cost, C, R, P

    def run(self, chunks, states=None, first=0):
        """states[i] = (send post times per layer, finish, wait, bytes sent, l0, d): from layer
        l0 on, rank i's send times grow by d per layer.  Recomputes ranks >= first.

        Per layer: post the receive of KV[0, start_i) (at t), QKV, wait for it, post the send
        of KV[0, end_i) (S[l]), attention + FFN.  Once a rank's state (clock, link) has moved
        by the same e in one layer, and either e equals the predecessor's period d or the
        predecessor's send was not binding and e >= d, every later layer repeats shifted by e
        (this recurrence is max-plus): the rest is extrapolated exactly (--self-test checks it
        against the full timeline).  Returns (ttft, states)."""
        cost, P, L = self.cost, self.P, self.cost.L
        lat, bw = cost.hw.lat, cost.hw.bw
        st = list(states[:first]) if states else []
        start = P + sum(chunks[:first])
        for i in range(first, self.R):
            c = chunks[i]
            a, b = start, start + c
            q = c * cost.s_qkv
            w = cost.pairs(a, b, 0, b) * cost.s_pair + c * cost.s_ffn
            sent = L * b * cost.kv_tok if i < self.R - 1 else 0
            t = cost.hw.overhead
            start = b
            if i == 0:
                S = [t + l * (q + w) + q for l in range(L)]
                st.append((S, t + L * (q + w), 0.0, sent, 0, q + w))
                continue
            prevS, _, _, _, pl0, pd = st[i - 1]
            occ = a * cost.kv_tok / bw  # KV [0, start_i) of this layer
            tol = 1e-12 * (abs(prevS[-1]) + 1.0)
            lf = t  # the link (i-1 -> i) is free from here on
            wait = 0.0
            S = [0.0] * L
            pt = plf = pw = None
            nonbind = False
            l0, d = L - 1, (0.0 if L < 2 else None)
            l = 0
            while l < L:
                if lf < t:
                    lf = t  # an idle link: a harmless clamp that makes the state periodic
                if self.extrapolate and pt is not None and l - 1 >= pl0:
                    e = t - pt
                    if abs(lf - plf - e) <= tol and (abs(e - pd) <= tol or
                                                     (nonbind and e >= pd - tol)):
                        dw = wait - pw
                        base = S[l - 1]
                        for j in range(l, L):
                            S[j] = base + (j - l + 1) * e
                        t += (L - l) * e
                        wait += (L - l) * dw
                        l0, d = l - 1, e
                        break
                pt, plf, pw = t, lf, wait
                sp = prevS[l]
                nonbind = sp < lf  # (lf >= t: the receive is posted by then)
                lf = (lf if lf > sp else sp) + occ
                arr = lf + lat
                t += q
                if arr > t:
                    wait += arr - t
                    t = arr
                S[l] = t  # send of [0, end_i) posted; attention runs meanwhile
                t += w
                l += 1
            if d is None:
                d = S[-1] - S[-2]
            st.append((S, t, wait, sent, l0, d))
        ttft = st[-1][1] + cost.t_logits
        return ttft, st

    def result(self, chunks):
        ttft, st = self.run(chunks)
        return result(ttft, [s[3] for s in st], [s[2] for s in st], {"partition": list(chunks)})


def balanced_partition(cost, C, R, P=0):
    """Chunks with equal per-layer compute (QKV + attention + FFN), by bisection on the
    cumulative work -- the starting point of the search."""
    per_tok = cost.s_qkv + cost.s_ffn

    def W(x):
        return x * per_tok + cost.pairs(P, P + x, 0, P + x) * cost.s_pair

    total = W(C)
    bounds = [0]
    for k in range(1, R):
        target = total * k / R
        lo, hi = bounds[-1] + 1, C - (R - k)
        while lo < hi:
            mid = (lo + hi) // 2
            if W(mid) < target:
                lo = mid + 1
            else:
                hi = mid
        bounds.append(max(lo, bounds[-1] + 1))
    bounds.append(C)
    return [bounds[i + 1] - bounds[i] for i in range(R)]


KVR_MAX_EVALS = 4000  # timelines per KVR-S search (R > 2)


def period_partition(cost, C, R, P=0):
    """Chunks that equalize the chain's steady-state period per layer, rank i's
    max(QKV_i, latency + KV[0, start_i) / bandwidth) + attention_i + FFN_i (the receive is
    posted at the start of the layer, so the transfer only overlaps the QKV projection):
    bisection on the period tau, ranks filled greedily from the last one.  A starting point of
    the search that accounts for communication."""
    lat, bw = cost.hw.lat, cost.hw.bw

    def per(a, b):  # rows [a, b) of the new tokens
        q = (b - a) * cost.s_qkv
        occ = lat + (P + a) * cost.kv_tok / bw if a + P > 0 else 0.0
        return max(q, occ) + cost.pairs(P + a, P + b, 0, P + b) * cost.s_pair + (
            b - a) * cost.s_ffn

    def fill(tau):
        bounds = [C]
        for r in range(R - 1, 0, -1):
            end = bounds[-1]
            lo, hi = r, end - 1  # start of rank r: leave >= 1 token to every earlier rank
            if per(hi, end) > tau:
                return None
            while lo < hi:
                mid = (lo + hi) // 2
                if per(mid, end) <= tau:
                    hi = mid
                else:
                    lo = mid + 1
            bounds.append(lo)
        if per(0, bounds[-1]) > tau:
            return None
        bounds.append(0)
        bounds.reverse()
        return [bounds[i + 1] - bounds[i] for i in range(R)]

    lo, hi = 0.0, per(0, C) + 1e-9
    best = fill(hi) or split_even(C, R)
    for _ in range(60):
        mid = (lo + hi) / 2
        ch = fill(mid)
        if ch:
            hi, best = mid, ch
        else:
            lo = mid
    return best


def search_kvr(cost, C, R, P=0, min_stride=None, max_evals=None):
    """KVR-S: the TTFT-minimizing contiguous partition (KV-Runahead §4.2).  R = 2: ternary
    search on the single boundary; R > 2: hierarchical coordinate search (Fig. 6 b-d) over the
    boundaries with halving strides, with two move kinds per boundary k: move b_k alone
    (trade tokens between ranks k-1 and k) and shift b_k..b_{R-1} together (trade between rank
    k-1 and the last rank), each move repeated with doubling steps while it improves; it
    starts from the best of the even, the equal-compute and the equal-period splits and stops
    after max_evals timelines (reached only on communication-bound chains of many ranks)."""
    chain = KvrChain(cost, C, R, P)
    evals = [0]
    if max_evals is None:
        max_evals = KVR_MAX_EVALS

    def ev(ch, states=None, first=0):
        evals[0] += 1
        return chain.run(ch, states, first)

    if R == 1:
        ttft, _ = ev([C])
        return [C], ttft, evals[0]
    if R == 2:
        lo, hi = 1, C - 1
        memo = {}

        def f(b):
            if b not in memo:
                memo[b] = ev([b, C - b])[0]
            return memo[b]

        while hi - lo > 2:
            m1 = lo + (hi - lo) // 3
            m2 = hi - (hi - lo) // 3
            if f(m1) <= f(m2):
                hi = m2
            else:
                lo = m1
        b = min(range(lo, hi + 1), key=f)
        for cand in (C // 2, balanced_partition(cost, C, 2, P)[0]):  # guard against plateaus
            if f(cand) < f(b):
                b = cand
        return [b, C - b], f(b), evals[0]
    starts = [split_even(C, R), balanced_partition(cost, C, R, P),
              period_partition(cost, C, R, P)]
    if min_stride is None:
        min_stride = max(1, C // (R * 512))
    found = []
    for n_start, ch in enumerate(starts):
        budget = evals[0] + (max_evals - evals[0]) // (len(starts) - n_start)
        found.append(_pattern_search(ev, ch, C, R, min_stride, budget, evals))
    ch, ttft = min(found, key=lambda x: x[1])
    return ch, ttft, evals[0]


def _pattern_search(ev, ch, C, R, min_stride, max_evals, evals):
    ttft, st = ev(ch)
    bounds = [sum(ch[:k]) for k in range(R + 1)]
    stride = max(min_stride, C // (4 * R))
    while True:
        improved_any = True
        sweeps = 0
        while improved_any and sweeps < 20:
            improved_any = False
            sweeps += 1
            for k in range(R - 1, 0, -1):
                for kind in (0, 1):
                    for sgn in (1, -1):
                        step = stride
                        while evals[0] < max_evals:  # accelerate while it keeps improving
                            nb = bounds[:]
                            if kind == 0:
                                nb[k] += sgn * step
                            else:
                                for j in range(k, R):
                                    nb[j] += sgn * step
                            if any(nb[j + 1] - nb[j] < 1 for j in range(R)):
                                break
                            nch = [nb[j + 1] - nb[j] for j in range(R)]
                            t2, st2 = ev(nch, st, k - 1)
                            if t2 < ttft * (1 - 1e-12):
                                bounds, ttft, st = nb, t2, st2
                                improved_any = True
                                step *= 2
                            else:
                                break
        if stride <= min_stride or evals[0] >= max_evals:
            break
        stride = max(min_stride, stride // 2)
    return [bounds[j + 1] - bounds[j] for j in range(R)], ttft


def cp_layout(T, P, N):
    """pdm__cp_assign: the T new tokens in 2N even chunks, rank i gets chunks i and 2N-1-i.
    The P cached tokens are assumed to come from an earlier cp prefill (same layout over P)."""
    def chunks_of(n, base):
        ch = split_even(n, 2 * N)
        rng = [[] for _ in range(N)]
        p = base
        for c in range(2 * N):
            r = c if c < N else 2 * N - 1 - c
            if ch[c]:
                rng[r].append((p, p + ch[c]))
            p += ch[c]
        return rng

    new = chunks_of(T, P)
    cached = chunks_of(P, 0) if P else [[] for _ in range(N)]
    kv = [cached[i] + new[i] for i in range(N)]
    return new, kv


def cp_blocks(cost, T, P, N):
    q_rng, kv_rng = cp_layout(T, P, N)
    nq = [sum(b - a for a, b in r) for r in q_rng]
    nkv = [sum(b - a for a, b in r) for r in kv_rng]
    pairs = cost.pairs
    # A[i][o]: attention time of rank i's queries against rank o's KV block
    A = [[sum(pairs(a, b, c, d) for a, b in q_rng[i] for c, d in kv_rng[o]) * cost.s_pair
          for o in range(N)] for i in range(N)]
    owner = 0  # the last new token is in chunk 2N-1, which belongs to rank 0
    return nq, nkv, A, owner


def _periodic(prev, cur, scale):
    """True when every component of the state moved by the same amount in the last layer."""
    d = [c - p for c, p in zip(cur, prev)]
    tol = 1e-12 * max(scale, 1e-9)
    return all(abs(x - d[0]) <= tol for x in d), d[0]


def sim_cp(cost, T, N, P=0, variant="kv"):
    """pdm__run_cp_kv / pdm__run_cp_q: N ring steps per layer, step s overlapping the
    attention on the current block with the send/receive of the next one; pass-Q ends each
    layer with an All2All of partial outputs.  Once the timeline is periodic (every rank and
    link shifted by the same time in a layer), the remaining layers are extrapolated exactly."""
    if N == 1:
        return sim_single(cost, T, P)
    nq, nkv, A, owner = cp_blocks(cost, T, P, N)
    lat, bw = cost.hw.lat, cost.hw.bw
    if variant == "kv":
        occ = [nkv[o] * cost.kv_tok / bw for o in range(N)]  # block of origin o
    else:
        occ = [nq[o] * cost.q_tok / bw for o in range(N)]  # Q rows of origin o
        o_out = [(sum(nq) - nq[j]) * cost.o_tok for j in range(N)]
        o_in = [(N - 1) * nq[i] * cost.o_tok for i in range(N)]
        a2a_rel = [lat + max(max(o_out), o_in[i]) / bw for i in range(N)]
    t = [cost.hw.overhead] * N
    lf = [0.0] * N  # link (i-1 -> i): egress of i-1 and ingress of i, only used by the ring
    wait = [0.0] * N
    sent = [0.0] * N
    layer_sent = [0.0] * N
    for i in range(N):
        prev = (i - 1) % N
        if variant == "kv":
            layer_sent[i] = sum(nkv[(i - s) % N] for s in range(N - 1)) * cost.kv_tok
        else:
            layer_sent[i] = (sum(nq[(i - s) % N] for s in range(N - 1)) * cost.q_tok +
                             o_out[i])
    L = cost.L
    hist = []
    l = 0
    while l < L:
        lo = min(t)
        lf = [max(x, lo) for x in lf]
        state = t + lf + wait
        hist.append(state)
        if len(hist) >= 3:
            ok1, d1 = _periodic(hist[-3][:2 * N], hist[-2][:2 * N], t[0])
            ok2, d2 = _periodic(hist[-2][:2 * N], hist[-1][:2 * N], t[0])
            if ok1 and ok2 and abs(d1 - d2) <= 1e-12 * max(t[0], 1e-9):
                k = L - l
                dw = [hist[-1][2 * N + i] - hist[-2][2 * N + i] for i in range(N)]
                t = [x + k * d2 for x in t]
                wait = [wait[i] + k * dw[i] for i in range(N)]
                break
        # QKV of the local rows, then step 0: post receive (step 1), send own block/Q, attend
        for i in range(N):
            t[i] += nq[i] * cost.s_qkv
        spost = t[:]  # send of step s posted by rank i (to i+1)
        rpost = t[:]  # receive of step s posted by rank i (from i-1)
        for i in range(N):
            t[i] += A[i][i]
        for s in range(1, N):
            arr = [0.0] * N
            for i in range(N):  # message of step s: rank i-1 -> rank i, origin (i - s)
                src = (i - 1) % N
                origin = (i - s) % N
                s0 = spost[src]
                if rpost[i] > s0:
                    s0 = rpost[i]
                if lf[i] > s0:
                    s0 = lf[i]
                lf[i] = s0 + occ[origin]
                arr[i] = lf[i] + lat
            for i in range(N):
                ready = max(arr[i], arr[(i + 1) % N])  # own receive and own send completed
                if ready > t[i]:
                    wait[i] += ready - t[i]
                    t[i] = ready
            for i in range(N):
                origin = (i - s) % N
                spost[i] = rpost[i] = t[i]  # forward this block / post the next receive
                if variant == "kv":
                    t[i] += A[i][origin] + nq[i] * cost.s_merge
                else:
                    t[i] += A[origin][i]
        if variant == "q":
            t0 = max(t)
            for i in range(N):
                d = t0 + a2a_rel[i]
                wait[i] += d - t[i]
                t[i] = d + (N - 1) * nq[i] * cost.s_merge
        for i in range(N):
            t[i] += nq[i] * cost.s_ffn
        l += 1
    sent = [L * x for x in layer_sent]
    t[owner] += cost.t_logits
    return result(max(t), sent, wait)


def predict(cost, method, C, R, P=0, search=True):
    """TTFT of `method` on R ranks for C new tokens after P cached ones."""
    if R == 1:
        return sim_single(cost, C, P)
    if method == "single":
        return None
    if method == "tsp":
        return None if P else sim_tsp(cost, C, R)
    if method == "kvr-e":
        return KvrChain(cost, C, R, P).result(split_even(C, R))
    if method == "kvr-s":
        ch, _, n = search_kvr(cost, C, R, P)
        r = KvrChain(cost, C, R, P).result(ch)
        r["search_evals"] = n
        return r
    if method == "cp-kv":
        return sim_cp(cost, C, R, P, "kv")
    if method == "cp-q":
        return sim_cp(cost, C, R, P, "q")
    raise ValueError(method)


def lower_bound(ttft1, p):
    """KV-Runahead eq. 2-3: TTFT*(p) = TTFT(1)/2 * (1/p + 1/p^2)."""
    return ttft1 / 2 * (1 / p + 1 / p ** 2)


# ---- Inputs ----------------------------------------------------------------------------------


def load_calibration(args):
    """(Hw, description).  Missing file: the spot numbers of docs/perf.md (1 thread, 600
    tokens, ~55 tok/s) for compute and a guess for the link, flagged as such."""
    path = args.calibration
    cal, src = None, None
    if path and os.path.exists(path):
        with open(path) as f:
            cal = json.load(f)
        src = "calibration file %s" % os.path.relpath(path, ROOT)
    if cal is None:
        m = MODELS[args.model]
        cal = {"flops": prefill_flops(m, 600) / (600 / 55.0), "bandwidth": 5e9, "latency": 5e-6}
        src = ("NO calibration file (%s missing): compute from docs/perf.md's spot number (600 "
               "tokens at ~55 tok/s, 1 thread), link 5 GB/s and 5 us ASSUMED -- run `pdmesh "
               "calibrate --out docs/perf/calibration.json` and regenerate" %
               os.path.relpath(path, ROOT) if path else "none")
    lin = args.linear_flops or cal["flops"]
    attn = args.attn_flops or cal["flops"]
    hw = Hw("calibration", lin, attn, args.bandwidth or cal["bandwidth"],
            args.latency if args.latency is not None else cal.get("latency", 0.0),
            note=src)
    return hw, src


def load_measured(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- Experiments -------------------------------------------------------------------------------


def scaling(cost, lengths, ranks, methods=MULTI, log=None):
    rows = []
    for C in lengths:
        one = sim_single(cost, C)["ttft"]
        for R in ranks:
            row = {"tokens": C, "ranks": R, "single": one, "bound": lower_bound(one, R)}
            for meth in methods:
                t0 = time.time()
                r = predict(cost, meth, C, R)
                row[meth] = r["ttft"]
                if meth == "kvr-s" and R > 1:
                    row["kvr-s_partition"] = r["partition"]
                    row["kvr-s_evals"] = r["search_evals"]
                row[meth + "_bytes"] = sum(r["bytes_sent"])
                if log and time.time() - t0 > 2:
                    log("  %s C=%d R=%d took %.1fs" % (meth, C, R, time.time() - t0))
            rows.append(row)
    return rows


# KV-Runahead App. A Table 1 (Llama 7B, A100, "high bandwidth network" = 300 GB/s): TTFT (s).
KVR_TABLE1 = {  # tokens: (TSP 4 GPUs, KVR-S 4 GPUs, TSP 8 GPUs, KVR-S 8 GPUs)
    1024: (0.107, 0.097, 0.117, 0.098), 2048: (0.111, 0.100, 0.117, 0.103),
    4096: (0.20, 0.17, 0.12, 0.11), 8192: (0.54, 0.41, 0.30, 0.22),
    12288: (1.06, 0.76, 0.57, 0.41), 16384: (1.76, 1.24, 0.92, 0.65)}
# App. B Table 3 (Llama 7B): KVR TTFT (s) with 2 and 4 GPUs at 10 GB/s and 1 GB/s.
KVR_TABLE3 = {1024: (0.10, 0.10, 0.11, 0.19), 2048: (0.16, 0.19, 0.21, 0.35),
              4096: (0.38, 0.36, 0.84, 0.93), 8192: (0.99, 0.72, 1.31, 2.06),
              12288: (1.82, 1.15, 2.28, 2.30)}


def kv_runahead_compare(quick):
    fit = fit_a100()
    m = MODELS["llama-7b"]
    base = Hw("a100-fit", fit["lin"], fit["attn"], 300 * GB, 10e-6, overhead=fit["c0"],
              mask="dense", note="A100 rates fitted to KV-Runahead App. B Table 3 single-GPU "
              "TTFTs: TTFT = %.3f s + %.4f s/ktok * C + %.4f s/ktok^2 * C^2 -> linear %.0f "
              "TFLOP/s, dense-masked attention %.0f TFLOP/s" % (
                  fit["c0"], fit["a"], fit["b"], fit["lin"] / 1e12, fit["attn"] / 1e12))
    lengths = [1024, 4096, 16384] if quick else sorted(KVR_TABLE1)
    out = {"fit": fit, "hw": base.to_json(), "table1": [], "table3": [], "bound": []}
    for bwname, bw in (("300GB/s", 300 * GB), ("10GB/s", 10 * GB)):
        for mask in ("dense", "causal"):
            cost = Cost(m, base.but(bw=bw, mask=mask))
            for C in lengths:
                for R in (4, 8):
                    tsp = sim_tsp(cost, C, R)["ttft"]
                    kve = predict(cost, "kvr-e", C, R)["ttft"]
                    kvs = predict(cost, "kvr-s", C, R)
                    row = {"bw": bwname, "mask": mask, "tokens": C, "ranks": R, "tsp": tsp,
                           "kvr-e": kve, "kvr-s": kvs["ttft"], "partition": kvs["partition"],
                           "speedup": tsp / kvs["ttft"]}
                    if C in KVR_TABLE1 and bwname == "300GB/s":
                        p = KVR_TABLE1[C][0:2] if R == 4 else KVR_TABLE1[C][2:4]
                        row["paper_tsp"], row["paper_kvr-s"] = p
                        row["paper_speedup"] = p[0] / p[1]
                    out["table1"].append(row)
    # Table 3: KVR (searched) on 2 and 4 GPUs at 10 GB/s and 1 GB/s, beside single GPU.
    for C in (lengths if quick else sorted(KVR_TABLE3)):
        cost1 = Cost(m, base)
        row = {"tokens": C, "single": sim_single(cost1, C)["ttft"]}
        for bwname, bw in (("10GB/s", 10 * GB), ("1GB/s", 1 * GB)):
            cost = Cost(m, base.but(bw=bw))
            for R in (2, 4):
                row["kvr-s %s R=%d" % (bwname, R)] = predict(cost, "kvr-s", C, R)["ttft"]
        if C in KVR_TABLE3:
            row["paper"] = KVR_TABLE3[C]
        out["table3"].append(row)
    # Lower bound (eq. 2-3) beside KVR-S, 16k tokens, no communication cost and with 300 GB/s.
    C = 16384
    for mask in ("dense", "causal"):
        cost = Cost(m, base.but(mask=mask))
        free = Cost(m, base.but(mask=mask, bw=float("inf"), lat=0.0))
        one = sim_single(cost, C)["ttft"]
        one_attn = Cost(m, base.but(mask=mask, lin=float("inf"), overhead=0.0))
        for R in (1, 2, 4, 8, 16):
            out["bound"].append({
                "mask": mask, "tokens": C, "ranks": R, "single": one,
                "bound": lower_bound(one, R),
                "kvr-s": predict(cost, "kvr-s", C, R)["ttft"],
                "kvr-s_free_comm": predict(free, "kvr-s", C, R)["ttft"],
                "tsp": predict(cost, "tsp", C, R)["ttft"],
                # attention only (what eq. 1-3 model): bound vs searched chain, free comm
                "attn_only_bound": lower_bound(sim_single(one_attn, C)["ttft"], R),
                "attn_only_kvr-s": predict(
                    Cost(m, base.but(mask=mask, lin=float("inf"), overhead=0.0,
                                     bw=float("inf"), lat=0.0)), "kvr-s", C, R)["ttft"]})
    return out


CP_TABLE4 = {3200: (1046, 1110), 6400: (1302, 1305), 12800: (2205, 2081)}  # T: (pass-Q, pass-KV) ms


def crossover(cost, total, N, lo=0.001, hi=0.5):
    """Miss rate T/(T+P) at which pass-KV and pass-Q TTFTs are equal (bisection on T); None
    if one variant wins over the whole range."""
    def diff(miss):
        T = max(2 * N, int(round(total * miss)))
        return sim_cp(cost, T, N, total - T, "kv")["ttft"] - sim_cp(cost, T, N, total - T,
                                                                      "q")["ttft"]
    a, b = diff(lo), diff(hi)
    if a * b > 0:
        return None
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        d = diff(mid)
        if d * a > 0:
            lo, a = mid, d
        else:
            hi = mid
    return math.sqrt(lo * hi)


def cp_compare(quick):
    m = MODELS["llama3-405b"]
    total, N = 128000, 4
    out = {"total": total, "ranks": N, "rows": [], "crossover": []}
    variants = [("h100-rdma", PRESETS["h100-rdma"]),
                ("h100-rdma, pdmesh f32 Q/O wire", PRESETS["h100-rdma"].but(wire="pdmesh")),
                ("h100-rdma at 1/2 bandwidth", PRESETS["h100-rdma"].but(
                    bw=PRESETS["h100-rdma"].bw / 2)),
                ("h100-rdma at 1/4 bandwidth", PRESETS["h100-rdma"].but(
                    bw=PRESETS["h100-rdma"].bw / 4)),
                ("h100-tcp", PRESETS["h100-tcp"])]
    if quick:
        variants = variants[:1]
    for name, hw in variants:
        cost = Cost(m, hw)
        for T in sorted(CP_TABLE4):
            P = total - T
            kv = sim_cp(cost, T, N, P, "kv")
            q = sim_cp(cost, T, N, P, "q")
            out["rows"].append({"hw": name, "T": T, "P": P, "miss": T / total,
                                "cp-kv": kv["ttft"], "cp-q": q["ttft"],
                                "cp-kv_wait": max(kv["wait"]), "cp-q_wait": max(q["wait"]),
                                "paper_cp-q": CP_TABLE4[T][0] / 1e3,
                                "paper_cp-kv": CP_TABLE4[T][1] / 1e3})
        out["crossover"].append({"hw": name, "miss": crossover(cost, total, N)})
    # Full prefill scaling beside Fig. 6a / Fig. 8 (pass-KV, GTT).
    full = []
    for C, Ns in ((128000, (1, 2, 4, 8, 16)), (1000000, (1, 8, 16))):
        for n in Ns:
            if quick and n > 8:
                continue
            full.append({"tokens": C, "ranks": n, "hw": "h100-rdma",
                         "cp-kv": sim_cp(Cost(m, PRESETS["h100-rdma"]), C, n, 0, "kv")["ttft"]})
    out["full"] = full
    return out


def validate(measured, cost, log):
    """R = 2 predictions (this model, this calibration) against bench/prefill/run.py's
    docs/perf/prefill.json: ratio predicted / measured per method and length."""
    rows = []
    parts = {}
    for r in measured.get("runs", []):
        if r.get("method") == "kvr-s" and r.get("partition") and not r.get("cached_tokens"):
            parts[int(r["prompt_tokens"])] = r["partition"]
    for n_s, row in sorted(measured.get("ttft", {}).items(), key=lambda kv: int(kv[0])):
        C = int(n_s)
        for meth in METHODS:
            meas = row.get(meth)
            R = 1 if meth == "single" else 2
            pred = predict(cost, meth if R > 1 else "single", C, R)
            e = {"tokens": C, "ranks": R, "method": meth, "measured": meas,
                 "predicted": pred["ttft"],
                 "ratio": pred["ttft"] / meas if meas else None}
            if meth == "kvr-s":
                e["predicted_partition"] = pred["partition"]
                if C in parts:
                    e["measured_partition"] = parts[C]
                    e["predicted_with_measured_partition"] = KvrChain(cost, C, 2).result(
                        parts[C])["ttft"]
            rows.append(e)
    cross = []
    pq = measured.get("pass_kv_vs_pass_q")
    if pq:
        for row in pq.get("rows", []):
            T, P = int(row["T"]), int(row["P"])
            e = {"T": T, "P": P, "miss": row.get("miss")}
            for meth, var in (("cp-kv", "kv"), ("cp-q", "q")):
                pred = sim_cp(cost, T, 2, P, var)["ttft"]
                e[meth + "_pred"] = pred
                e[meth + "_meas"] = row.get(meth)
                e[meth + "_ratio"] = pred / row[meth] if row.get(meth) else None
            cross.append(e)
    return {"rows": rows, "pass_kv_vs_pass_q": cross,
            "machine": measured.get("machine"), "reps": measured.get("reps")}


# ---- Self-test ---------------------------------------------------------------------------------


def self_test():
    fails = []

    def check(cond, what):
        print("%s  %s" % ("ok  " if cond else "FAIL", what))
        if not cond:
            fails.append(what)

    # closed-form pair counts against brute force
    import itertools
    ok = True
    for a, b, c, d in itertools.product(range(0, 7, 2), range(0, 9, 3), range(0, 7, 3),
                                        range(0, 9, 2)):
        bf = sum(1 for q in range(a, b) for k in range(c, d) if k <= q)
        ok &= causal_pairs(a, b, c, d) == bf
    check(ok, "causal_pairs matches brute force")
    check(split_even(10, 4) == [2, 2, 3, 3], "split_even like pdm_prefill_split_even")
    hw = Hw("t", 1e10, 1e10, 1e9, 1e-5)
    for mname in ("smollm2-135m", "llama3-405b"):
        cost = Cost(MODELS[mname], hw)
        for C in (1000, 65536):
            one = sim_single(cost, C)["ttft"]
            same = all(abs(predict(cost, meth, C, 1)["ttft"] - one) <= 1e-12 * one
                       for meth in MULTI)
            check(same, "%s C=%d: R=1 of every method equals single" % (mname, C))
            # explicit N=1 paths of the simulators too
            r1 = [sim_tsp(cost, C, 1)["ttft"], KvrChain(cost, C, 1).result([C])["ttft"],
                  sim_cp(cost, C, 1)["ttft"], sim_cp(cost, C, 1, 0, "q")["ttft"]]
            check(all(abs(x - one) <= 1e-12 * one for x in r1),
                  "%s C=%d: one-rank timelines equal single" % (mname, C))
    for mname, C, R, bw in (("smollm2-135m", 8192, 2, 1e9), ("smollm2-135m", 32768, 4, 1e8),
                            ("llama-7b", 16384, 8, 3e11), ("llama3-8b", 131072, 16, 1e10)):
        cost = Cost(MODELS[mname], hw.but(bw=bw))
        e = predict(cost, "kvr-e", C, R)["ttft"]
        s = predict(cost, "kvr-s", C, R)["ttft"]
        check(s <= e * (1 + 1e-12), "%s C=%d R=%d bw=%g: KVR-S %.4g <= KVR-E %.4g" % (
            mname, C, R, bw, s, e))
    # traffic: KV-Runahead eq. 5 (TSP (p-1)C) and eq. 7 (KVR (p-1)C/2), in KV entries
    m = MODELS["llama-7b"]
    cost = Cost(m, hw)
    for C, p in ((16384, 4), (12288, 8), (4096, 2)):
        entries = cost.L * cost.kv_tok
        tsp = sum(sim_tsp(cost, C, p)["bytes_sent"]) / entries
        kvr = sum(predict(cost, "kvr-e", C, p)["bytes_sent"]) / entries
        check(tsp == (p - 1) * C and kvr == (p - 1) * C / 2,
              "C=%d p=%d: TSP traffic %g = (p-1)C (eq. 5), KVR-E %g = (p-1)C/2 (eq. 7)" % (
                  C, p, tsp, kvr))
    # free communication: pass-KV approaches single/R on long contexts (the 2N-chunk
    # load balancing of CP §3.5.1 balances the causal work)
    free = hw.but(bw=float("inf"), lat=0.0)
    for mname, C, R in (("smollm2-135m", 1 << 20, 4), ("llama3-405b", 1 << 19, 8),
                        ("smollm2-135m", 1 << 20, 16)):
        cost = Cost(MODELS[mname], free)
        one = sim_single(cost, C)["ttft"]
        kv = sim_cp(cost, C, R)["ttft"]
        check(one / R * (1 - 1e-9) <= kv <= one / R * 1.02,
              "%s C=%d R=%d free links: pass-KV / (single/R) = %.4f" % (mname, C, R,
                                                                        kv / (one / R)))
    # eq. 1-3 in its own setting (dense masked kernels, attention only, free links): searched
    # KVR never beats the bound TTFT*(p) and gets close to it
    cost = Cost(m, hw.but(bw=float("inf"), lat=0.0, lin=float("inf"), mask="dense"))
    for p in (2, 4, 8):
        C = 16384
        one = sim_single(cost, C)["ttft"]
        s = predict(cost, "kvr-s", C, p)["ttft"]
        b = lower_bound(one, p)
        check(b * (1 - 1e-9) <= s <= b * 1.25, "dense attention only, p=%d: KVR-S / TTFT*(p) "
              "= %.4f" % (p, s / b))
    # more bandwidth never hurts
    ok = True
    for meth in MULTI:
        prev = None
        for bw in (1e7, 1e8, 1e9, 1e10, 1e11):
            t = predict(Cost(MODELS["smollm2-135m"], hw.but(bw=bw)), meth, 8192, 4)["ttft"]
            ok &= prev is None or t <= prev * (1 + 1e-9)
            prev = t
    check(ok, "TTFT is non-increasing in bandwidth for every method")
    # the periodic extrapolation of the KVR chain equals the full timeline
    import random
    rnd = random.Random(1)
    worst = 0.0
    for mname in ("smollm2-135m", "llama3-405b", "llama-7b"):
        for bw in (1e7, 1e9, 1e11, float("inf")):
            cost = Cost(MODELS[mname], hw.but(bw=bw))
            for R in (2, 3, 5, 8):
                C = rnd.choice((1000, 30000, 200000))
                cuts = sorted(rnd.sample(range(1, C), R - 1))
                ch = [b - a for a, b in zip([0] + cuts, cuts + [C])]
                for bal in (False, True):
                    if bal:
                        ch = balanced_partition(cost, C, R)
                    chain = KvrChain(cost, C, R)
                    x = chain.run(ch)[0]
                    chain.extrapolate = False
                    y = chain.run(ch)[0]
                    worst = max(worst, abs(x - y) / y)
    check(worst <= 1e-9, "KVR chain extrapolation is exact (worst relative error %.1e)" % worst)
    # the periodic extrapolation of the ring equals the full timeline
    cost = Cost(MODELS["smollm2-135m"], hw.but(bw=3e8))
    cost_x = Cost(MODELS["smollm2-135m"], hw.but(bw=3e8))
    full = _sim_cp_noextrap(cost_x, 20000, 4, 3000, "kv")
    check(abs(sim_cp(cost, 20000, 4, 3000, "kv")["ttft"] - full) <= 1e-9 * full,
          "ring timeline extrapolation is exact")
    if fails:
        print("%d check(s) failed" % len(fails))
        return 1
    print("all checks passed")
    return 0


def _sim_cp_noextrap(cost, T, N, P, variant):
    global _periodic
    saved = _periodic
    _periodic = lambda prev, cur, scale: (False, 0.0)  # noqa: E731
    try:
        return sim_cp(cost, T, N, P, variant)["ttft"]
    finally:
        _periodic = saved


# ---- Output ------------------------------------------------------------------------------------


def fmt_t(x):
    if x is None:
        return "-"
    if x >= 100:
        return "%.0f" % x
    if x >= 10:
        return "%.1f" % x
    if x >= 0.1:
        return "%.2f" % x
    if x >= 0.001:
        return "%.1f ms" % (x * 1e3)
    return "%.0f us" % (x * 1e6)


def fmt_n(C):
    return "%dM" % (C >> 20) if C >= 1 << 20 and C % (1 << 20) == 0 else (
        "%dK" % (C >> 10) if C % 1024 == 0 else str(C))


def scaling_table(rows, C, title):
    lines = ["**%s, %s tokens** (TTFT in seconds unless marked; speed-up = single / TTFT)" % (
        title, fmt_n(C)), "",
        "| ranks | TSP | KVR-E | KVR-S | pass-KV | pass-Q | best | speed-up of best | "
        "TTFT*(p) (eq. 3) | KVR-S first chunks |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["tokens"] != C:
            continue
        best = min(MULTI, key=lambda k: r[k])
        part = r.get("kvr-s_partition")
        ptxt = "-" if not part else ", ".join("%.1f%%" % (100.0 * x / C) for x in part[:4]) + (
            ", ..." if len(part) > 4 else "")
        kvs = fmt_t(r["kvr-s"]) + (" (b)" if r.get("kvr-s_evals", 0) >= KVR_MAX_EVALS else "")
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %.2f | %s | %s |" % (
            r["ranks"], fmt_t(r["tsp"]), fmt_t(r["kvr-e"]), kvs,
            fmt_t(r["cp-kv"]), fmt_t(r["cp-q"]), best if r["ranks"] > 1 else "single",
            r["single"] / r[best], fmt_t(r["bound"]), ptxt))
    return lines


def write_md(res, path):
    hw = res["calibration"]
    L = []
    L += ["# Prefill methods: simulated TTFT (cost model)", "",
          "Generated by `python3 bench/sim/sim.py%s` on %s in %.1f s (standard library only). "
          "Every number here is a **prediction** of the cost model in `bench/sim/sim.py`, not a "
          "measurement; measured numbers are in `docs/perf/prefill.md` (bench/prefill) and the "
          "comparison with them is in [Validation](#validation-against-measurements)." % (
              " --quick" if res["quick"] else "", res["generated"], res["runtime_s"]), ""]
    L += ["## Model", "",
          "An event timeline per layer and rank that follows `prefill_node/rank.c`:", "",
          "- **compute** = FLOPs / rate. Linear part (Q/K/V/O projections, FFN): 2 FLOP per "
          "multiply-add per token, the count of `pdmesh calibrate`. Attention: 4 x head_dim "
          "FLOP per query-key pair per head; pdmesh's flash attention skips masked keys, so a "
          "rank with rows [a, b) does sum_{i=a}^{b-1} (i+1) pairs against the prefix (exact "
          "closed-form counts per block, never per token). Logits (2 x d_model x n_vocab) on "
          "the rank that owns the last token. Merges of partial attention: 3 x NH x head_dim "
          "FLOP per row.",
          "- **messages** = latency + bytes / bandwidth; a transfer starts when both its send "
          "and its receive are posted (rendezvous; kvtransfer/group.c posts receives first) and "
          "the sender's egress and receiver's ingress are free (per-rank full-duplex links). "
          "KV on the wire: f16, K and V, NKV x head_dim per token per layer. pass-Q: Q rows "
          "in f32 + an int32 position (NH x head_dim x 4 + 4 bytes per token), All2All of "
          "partial outputs NH x (head_dim + 1) x 4 bytes per token (rank.c's formats).",
          "- **collectives** (TSP all-gather, pass-Q All2All: direct sends to every other "
          "rank): rank i is done at max(posts) + latency + max(max_j bytes out of j, bytes "
          "into i) / bandwidth.",
          "- **tsp**: QKV, all-gather (a barrier: every layer waits for the slowest rank, which "
          "is the last one because its causal rows see the most keys), attention, FFN.",
          "- **kvr-e / kvr-s**: rank i posts the receive of KV[0, start_i) before its QKV, waits "
          "for it after QKV, sends KV[0, end_i) asynchronously (the send overlaps attention "
          "and the following layers), then attention + FFN. TTFT = the last rank's end + "
          "logits. KVR-S searches the partition inside the simulator (R = 2: ternary search; R "
          "> 2: hierarchical coordinate search with halving strides, as KV-Runahead §4.2 / Fig. "
          "6, down to a stride of C / (512 R) tokens).",
          "- **cp-kv / cp-q** (CP paper §3.5): 2N chunks, rank i holds chunks i and 2N-1-i; N "
          "ring steps per layer, each waiting for the neighbour's block (receive) and for its "
          "own previous send, then posting the next send/receive and computing on the current "
          "block, so a step costs max(compute, communication). pass-Q adds the All2All and "
          "N-1 merges. Partial prefill: only the T new tokens are sharded; the P cached tokens "
          "are laid out as an earlier cp prefill would have left them.", "",
          "Assumptions and limits: constant rates (no small-matrix inefficiency, no per-op "
          "overhead, no cache effects); communication progress is free (pdmesh's UCX progress "
          "thread and shared-memory copies actually take CPU time from the rank's core); no "
          "contention between unrelated flows beyond the per-rank ports; identical ranks; "
          "no decode. The search finds the model's optimum, not the machine's.", ""]
    L += ["## Calibration", "",
          "This model: %s. Linear rate %.3g GFLOP/s, attention rate %.3g GFLOP/s, bandwidth "
          "%.3g GB/s, latency %.3g us. Source: %s." % (
              res["model"]["title"], hw["lin"] / 1e9, hw["attn"] / 1e9, hw["bw"] / 1e9,
              hw["lat"] * 1e6, hw["note"]), "",
          "Presets for the paper-scale comparisons:", ""]
    for name, p in res["presets"].items():
        L.append("- `%s`: %s." % (name, p["note"]))
    L.append("")
    L += ["## Scaling with ranks: %s on this machine's calibration" % res["model"]["title"], "",
          "`best` is the fastest multi-rank method; TTFT*(p) is KV-Runahead's lower bound "
          "TTFT(1)/2 x (1/p + 1/p^2) (eq. 2-3) computed from the single-rank prediction; the "
          "last column is KVR-S's searched chunk sizes (share of the prompt) of the first "
          "ranks. The bound assumes attention dominates (TTFT(1) = alpha C^2); where the "
          "linear part dominates (short prompts) it is below anything reachable, and with our "
          "causal kernels the hard floor is TTFT(1)/p. (b) marks a KVR-S search that used up "
          "its budget of %d timelines before converging (communication-bound chains of many "
          "ranks): that value is an upper bound of the model's optimum." % KVR_MAX_EVALS, ""]
    for C in res["scaling_lengths"]:
        L += scaling_table(res["scaling"], C, res["model"]["title"]) + [""]
    for key, title in (("scaling_8b", "Llama-3-8B on h100-rdma"),
                       ("scaling_405b", "Llama-3-405B on h100-rdma")):
        if res.get(key):
            for C in sorted({r["tokens"] for r in res[key]}):
                L += scaling_table(res[key], C, title) + [""]
    # KV-Runahead comparison
    kv = res["kv_runahead"]
    L += ["## Beside KV-Runahead (Cho et al., ICML 2024)", "",
          "Llama-7B shape (32 layers, d 4096, FFN 11008, 32 heads, 32 KV heads, head_dim "
          "128). The paper measured 8xA100 with PyTorch/NCCL and eager attention that computes "
          "the masked rectangle; we have no A100 numbers of our own, so the rates come from a "
          "fit to the paper's own single-GPU TTFTs: %s. `dense` = that kernel (the paper's "
          "setting), `causal` = pdmesh's flash attention that skips masked keys (same per-pair "
          "rate). Paper numbers: App. A Table 1 (\"Llama 7B\", TSP vs KVR-S TTFT in seconds, "
          "4 and 8 GPUs over the high-bandwidth 300 GB/s network; the brief calls it the "
          "Appendix B table, in the seed text it is App. A's Table 1), quoted from "
          "/work/shared/seeds/kv-runahead.md." % kv["hw"]["note"], "",
          "| link | kernel | tokens | ranks | TSP | KVR-E | KVR-S | speed-up KVR-S/TSP | "
          "paper TSP | paper KVR-S | paper speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in kv["table1"]:
        L.append("| %s | %s | %s | %d | %s | %s | %s | %.2f | %s | %s | %s |" % (
            r["bw"], r["mask"], fmt_n(r["tokens"]), r["ranks"], fmt_t(r["tsp"]),
            fmt_t(r["kvr-e"]), fmt_t(r["kvr-s"]), r["speedup"],
            fmt_t(r.get("paper_tsp")), fmt_t(r.get("paper_kvr-s")),
            "%.2f" % r["paper_speedup"] if "paper_speedup" in r else "-"))
    L += ["", "The paper's 10 GB/s claims (Fig. 8 e-f, text only in the seed): KVR-E 1.55x over "
          "TSP at 4 GPUs and 8k, KVR-S 1.79x at 4 GPUs and 12k.", "",
          "App. B Table 3 (KVR TTFT on 2 and 4 GPUs with slow links; dense kernels), predicted "
          "vs paper (in parentheses):", "",
          "| tokens | single | 10 GB/s, 2 | 10 GB/s, 4 | 1 GB/s, 2 | 1 GB/s, 4 |",
          "|---|---|---|---|---|---|"]
    for r in kv["table3"]:
        p = r.get("paper")
        cells = []
        for k, key in enumerate(("kvr-s 10GB/s R=2", "kvr-s 10GB/s R=4", "kvr-s 1GB/s R=2",
                                 "kvr-s 1GB/s R=4")):
            cells.append("%s (%s)" % (fmt_t(r[key]), fmt_t(p[k]) if p else "-"))
        L.append("| %s | %s (%s) | %s |" % (fmt_n(r["tokens"]), fmt_t(r["single"]),
                                            fmt_t(KVR_TABLE3_1GPU.get(r["tokens"])),
                                            " | ".join(cells)))
    L += ["", "At 1 GB/s the model is more pessimistic than the paper (it predicts almost no gain "
          "over one GPU where the paper measured 1.31 s vs 1.95 s at 8k on 2 GPUs): in the model "
          "a layer's KV transfer starts only when the receiver posts its receive at the start of "
          "that layer (rank.c's order, rendezvous), so it overlaps only the QKV projection; "
          "transfers that ran ahead during the previous layer would hide more.", ""]
    L += ["Lower bound TTFT*(p) = TTFT(1)/2 (1/p + 1/p^2) (eq. 2-3) beside KVR-S, 16K "
          "tokens, 300 GB/s; `free comm` = infinite bandwidth, zero latency (the paper's "
          "practical bound TTFT(p), Fig. 8d); `attention only` = the setting eq. 1-3 assume "
          "(linear part free, overhead 0).", "",
          "| kernel | ranks | TSP | KVR-S | KVR-S free comm | TTFT*(p) | attention only: KVR-S | "
          "attention only: TTFT*(p) |", "|---|---|---|---|---|---|---|---|"]
    for r in kv["bound"]:
        L.append("| %s | %d | %s | %s | %s | %s | %s | %s |" % (
            r["mask"], r["ranks"], fmt_t(r["tsp"]), fmt_t(r["kvr-s"]),
            fmt_t(r["kvr-s_free_comm"]), fmt_t(r["bound"]), fmt_t(r["attn_only_kvr-s"]),
            fmt_t(r["attn_only_bound"])))
    # CP comparison
    cp = res["cp"]
    L += ["", "## Beside Context Parallelism (arXiv 2411.01783)", "",
          "Llama-3-405B (126 layers, d 16384, FFN 53248, 128 heads, 8 KV heads), one CP rank = "
          "one 8xH100 node; partial prefill at T + P = %d on CP%d, pass-KV vs pass-Q, beside "
          "the paper's Table 4 (§4.2.4, quoted from /work/shared/seeds/context-parallelism.md "
          "§5.4: 2.5%%: pass-Q 1046 ms vs pass-KV 1110 ms; 5%%: 1302 vs 1305; 10%%: pass-KV "
          "2081 vs pass-Q 2205). `wait` = the worst rank's exposed communication." % (
              cp["total"], cp["ranks"]), "",
          "| hardware | miss rate | T | pass-KV | pass-Q | faster | pass-KV wait | pass-Q wait | "
          "paper pass-KV | paper pass-Q | paper faster |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cp["rows"]:
        L.append("| %s | %.1f%% | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["hw"], 100 * r["miss"], r["T"], fmt_t(r["cp-kv"]), fmt_t(r["cp-q"]),
            "pass-KV" if r["cp-kv"] <= r["cp-q"] else "pass-Q", fmt_t(r["cp-kv_wait"]),
            fmt_t(r["cp-q_wait"]), fmt_t(r["paper_cp-kv"]), fmt_t(r["paper_cp-q"]),
            "pass-KV" if r["paper_cp-kv"] <= r["paper_cp-q"] else "pass-Q"))
    L += ["", "Predicted crossover miss rate (pass-Q faster below it; paper: about 5%, Fig. 9; "
          "message-size bound 2 NKV/NH = 12.5%, Eq. 1):", ""]
    for r in cp["crossover"]:
        L.append("- %s: %s" % (r["hw"], "none in 0.1%..50% (one variant always wins)"
                                if r["miss"] is None else "%.2f%%" % (100 * r["miss"])))
    L += ["", "Full prefill with pass-KV on h100-rdma beside the paper (Fig. 6a: CP8 128K in "
          "5.85 s; Fig. 8: CP16 128K in 3.8 s and 1M in 77 s; Table 6: CP1 (TP8) 128K TTFT 42 s; "
          "§1: ~60 s for 128K and ~1200 s for 1M on one host):", "",
          "| tokens | nodes | predicted pass-KV | paper |", "|---|---|---|---|"]
    paper_full = {(128000, 1): "42 s (Table 6), ~60 s (§1)", (128000, 8): "5.85 s",
                  (128000, 16): "3.8 s", (1000000, 16): "77 s", (1000000, 1): "~1200 s (§1)"}
    for r in cp["full"]:
        L.append("| %s | %d | %s | %s |" % ("128K" if r["tokens"] == 128000 else "1M",
                                             r["ranks"], fmt_t(r["cp-kv"]),
                                             paper_full.get((r["tokens"], r["ranks"]), "-")))
    # validation
    L += ["", "## Validation against measurements", ""]
    v = res.get("validation")
    if not v:
        L += [res.get("validation_note", "No measurements."), ""]
    else:
        L += ["R = 2 predictions with this calibration beside `docs/perf/prefill.json` "
              "(bench/prefill/run.py, %s, median of %s runs). single is R = 1; the calibration's "
              "compute rate comes from a single-rank prefill, so `single` near 1.0 only checks "
              "consistency." % ((v.get("machine") or {}).get("date", "?"), v.get("reps")), "",
              "| tokens | method | measured | predicted | predicted / measured | note |",
              "|---|---|---|---|---|---|"]
        for r in v["rows"]:
            note = ""
            if "measured_partition" in r:
                note = "measured partition %s (sim: %s s); sim's own %s" % (
                    r["measured_partition"], fmt_t(r["predicted_with_measured_partition"]),
                    r["predicted_partition"])
            elif "predicted_partition" in r:
                note = "sim partition %s" % r["predicted_partition"]
            L.append("| %d | %s | %s | %s | %s | %s |" % (
                r["tokens"], r["method"], fmt_t(r["measured"]), fmt_t(r["predicted"]),
                "%.2f" % r["ratio"] if r["ratio"] else "-", note))
        if v["pass_kv_vs_pass_q"]:
            L += ["", "| miss rate | T | P | pass-KV meas | pass-KV pred | ratio | pass-Q meas | "
                  "pass-Q pred | ratio |", "|---|---|---|---|---|---|---|---|---|"]
            for r in v["pass_kv_vs_pass_q"]:
                L.append("| %.3f | %d | %d | %s | %s | %s | %s | %s | %s |" % (
                    r["miss"] or r["T"] / (r["T"] + r["P"]), r["T"], r["P"],
                    fmt_t(r["cp-kv_meas"]), fmt_t(r["cp-kv_pred"]),
                    "%.2f" % r["cp-kv_ratio"] if r["cp-kv_ratio"] else "-",
                    fmt_t(r["cp-q_meas"]), fmt_t(r["cp-q_pred"]),
                    "%.2f" % r["cp-q_ratio"] if r["cp-q_ratio"] else "-"))
        L.append("")
    L += ["## Reproduce", "", "```sh", "python3 bench/sim/sim.py            # full run, ~1 min",
          "python3 bench/sim/sim.py --quick    # subset", "python3 bench/sim/sim.py --self-test",
          "python3 bench/sim/sim.py --calibration docs/perf/calibration.json "
          "--measured docs/perf/prefill.json", "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def plot(res, out_dir):
    if not shutil.which("gnuplot"):
        sys.stderr.write("gnuplot not found: no PNG\n")
        return False
    data = os.path.join(out_dir, "sim.dat.tmp")
    lengths = res["scaling_lengths"]
    with open(data, "w") as f:
        for C in lengths:
            for r in res["scaling"]:
                if r["tokens"] == C:
                    f.write("%d %s %g\n" % (r["ranks"], " ".join("%g" % r[m] for m in MULTI),
                                            r["bound"]))
            f.write("\n\n")
    png = os.path.join(out_dir, "sim.png")
    cols = ["TSP", "KVR-E", "KVR-S", "pass-KV", "pass-Q", "TTFT*(p)"]
    script = ["set terminal pngcairo size 1200,900 font ',10'", "set output '%s'" % png,
              "set logscale xy", "set xlabel 'ranks'", "set ylabel 'TTFT (s)'", "set grid",
              "set key top right", "set xtics (1,2,4,8,16,32,64)",
              "set multiplot layout 2,2 title 'Simulated TTFT, %s, calibration: %s'" % (
                  res["model"]["title"], "file" if res["calibration_file"] else "fallback")]
    for k, C in enumerate(lengths):
        script.append("set title '%s tokens'" % fmt_n(C))
        script.append("plot " + ", ".join(
            "'%s' index %d using 1:%d with linespoints title '%s'%s" % (
                data, k, i + 2, c, " dt 2 lc rgb 'gray'" if c == "TTFT*(p)" else "")
            for i, c in enumerate(cols)))
    script.append("unset multiplot")
    p = subprocess.run(["gnuplot"], input="\n".join(script), text=True, capture_output=True)
    os.unlink(data)
    if p.returncode != 0:
        sys.stderr.write("gnuplot failed: %s\n" % p.stderr)
        return False
    return True


# ---- Main ----------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", default=os.path.join(ROOT, "docs/perf/calibration.json"))
    ap.add_argument("--measured", default=os.path.join(ROOT, "docs/perf/prefill.json"))
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--attn-flops", type=float, help="attention FLOP/s (default: calibration)")
    ap.add_argument("--linear-flops", type=float, help="linear FLOP/s (default: calibration)")
    ap.add_argument("--bandwidth", type=float, help="bytes/s (default: calibration)")
    ap.add_argument("--latency", type=float, help="seconds (default: calibration)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs/perf"))
    ap.add_argument("--quick", action="store_true", help="a fast subset")
    ap.add_argument("--self-test", action="store_true", help="check invariants and exit")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        sys.exit(self_test())
    t_start = time.time()

    def log(s):
        sys.stderr.write("[%5.1fs] %s\n" % (time.time() - t_start, s))

    hw, src = load_calibration(args)
    log("calibration: " + src)
    m = MODELS[args.model]
    cost = Cost(m, hw)
    ranks = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    lengths = [4096, 32768] if args.quick else [4096, 32768, 131072, 1 << 20]
    res = {"generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "quick": args.quick, "model": m, "calibration": hw.to_json(),
           "calibration_file": os.path.exists(args.calibration or ""),
           "presets": {k: v.to_json() for k, v in PRESETS.items()},
           "scaling_lengths": lengths, "ranks": ranks}
    log("scaling %s: %s tokens x %s ranks" % (m["title"], lengths, ranks))
    res["scaling"] = scaling(cost, lengths, ranks, log=log)
    if not args.quick:
        log("scaling Llama-3-8B and Llama-3-405B on h100-rdma")
        res["scaling_8b"] = scaling(Cost(MODELS["llama3-8b"], PRESETS["h100-rdma"]),
                                    [131072, 1 << 20], [1, 4, 16, 64], log=log)
        res["scaling_405b"] = scaling(Cost(MODELS["llama3-405b"], PRESETS["h100-rdma"]),
                                      [131072, 1 << 20], [1, 4, 16, 64], log=log)
    log("KV-Runahead comparison")
    res["kv_runahead"] = kv_runahead_compare(args.quick)
    log("Context Parallelism comparison")
    res["cp"] = cp_compare(args.quick)
    measured = load_measured(args.measured)
    if measured is None:
        res["validation"] = None
        res["validation_note"] = ("No measurements: %s does not exist yet (run `make "
                                  "bench-prefill`, i.e. bench/prefill/run.py, then regenerate)."
                                  % os.path.relpath(args.measured, ROOT))
        log(res["validation_note"])
    else:
        log("validation against " + args.measured)
        res["validation"] = validate(measured, cost, log)
    res["runtime_s"] = time.time() - t_start
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "sim.json"), "w") as f:
        json.dump(res, f, indent=1, default=lambda x: None)
    write_md(res, os.path.join(args.out_dir, "sim.md"))
    if not args.no_plot:
        plot(res, args.out_dir)
    log("wrote %s/sim.{json,md,png}" % os.path.relpath(args.out_dir, ROOT))


if __name__ == "__main__":
    main()
