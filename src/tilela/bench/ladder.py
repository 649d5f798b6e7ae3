"""Linear-attention ladder benchmark (levels 1-4), ours against FLA on identical inputs.

    level 1  chunk_linear_attn   S += k v^T                          FLA: chunk_linear_attn(normalize=False)
    level 2  chunk_simple_gla    S = exp(g_t) S + k v^T, g [B,T,H]   FLA: chunk_simple_gla
    level 3  chunk_gla           g per key channel [B,T,H,K]         FLA: chunk_gla
    level 4  chunk_delta_rule    delta rule, no gate                 FLA: chunk_delta_rule

Also `tilela_unsplit`: levels 1, 2 and 4 with the sequence split off, where the op splits
(kernels.hopper.plan.auto_split). Inputs: B = 1, l2-normalised bf16 q/k, bf16 v, D = 128, gates
logsigmoid(randn) / 16 in float32, sigmoid beta in float32, float32 initial state, final state out. Grid: T in
{8192, 32768} x H in {16, 32}. Level 1 also runs the seed-002 §4 sequence-in-grid kernel (each chunk recomputes its prefix) at T in {2048, 8192,
32768}, H = 16: its time grows as N^2 against the sequence-in-loop kernel's N (seed 002 §6).
Floor: q, k, v (g, beta) read once, o written once, the state read and written once; FLOPs of the chunk
form (per chunk and head Q S, Q K^T, P V, K^T V; the delta rule adds K K^T, K S and A R).
"""

import torch
import torch.nn.functional as F

from tilela import reference

from . import Bench, Case, _try_import, ours_variant

DIM = 128
CHUNK = 64
LEVELS = {1: "chunk_linear_attn", 2: "chunk_simple_gla", 3: "chunk_gla", 4: "chunk_delta_rule"}
GATES = {1: "none", 2: "scalar", 3: "channel", 4: "none"}
FLA_MODULES = {1: "fla.ops.linear_attn", 2: "fla.ops.simple_gla", 3: "fla.ops.gla", 4: "fla.ops.delta_rule"}


def _case(level, T, H):
    return Case(f"L{level}_{LEVELS[level]}_T{T}_H{H}", dict(level=level, T=T, H=H, K=DIM, V=DIM))


def cases(quick):
    grid = [(8192, 16)] if quick else [(T, H) for T in (8192, 32768) for H in (16, 32)]
    return [_case(level, T, H) for level in LEVELS for T, H in grid] + [_case(1, 2048, 16)]


def make_inputs(case, seed):
    p = case.params
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, K, V = p["T"], p["H"], p["K"], p["V"]
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    x = dict(q=F.normalize(randn(1, T, H, K), dim=-1).to(torch.bfloat16),
             k=F.normalize(randn(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=randn(1, T, H, V).to(torch.bfloat16), initial_state=randn(1, H, K, V) * 0.1)
    if p["level"] == 2:
        x["g"] = F.logsigmoid(randn(1, T, H)) / 16
    if p["level"] == 3:
        x["g"] = F.logsigmoid(randn(1, T, H, K)) / 16
    if p["level"] == 4:
        x["beta"] = randn(1, T, H).sigmoid()
    return x


def _gate_args(x):
    return [x[n] for n in ("g", "beta") if n in x]


def _ours(case, x):
    import tilela

    plain = {"normalize": False} if case.params["level"] == 1 else {}  # as FLA's side runs it
    o, _ = getattr(tilela, LEVELS[case.params["level"]])(x["q"], x["k"], x["v"], *_gate_args(x),
                                                         initial_state=x["initial_state"], output_final_state=True,
                                                         **plain)
    return o


def _ours_unsplit(case, x):
    return ours_variant(x, [case.params["T"]], case.params["K"], GATES[case.params["level"]], split=None)


def _ours_seq_in_grid(case, x):
    if case.params["level"] != 1:
        return None
    from tilela.experiments.linear_attn_seq_in_grid import linear_attn_seq_in_grid

    o, _ = linear_attn_seq_in_grid(x["q"], x["k"], x["v"], case.params["K"] ** -0.5,
                                   initial_state=x["initial_state"], output_final_state=True)
    return o


def _fla(case, x):
    level = case.params["level"]
    module = _try_import(FLA_MODULES[level])
    if module is None:
        return None
    extra = {"normalize": False} if level == 1 else {}
    o, _ = getattr(module, LEVELS[level])(x["q"], x["k"], x["v"], *_gate_args(x), initial_state=x["initial_state"],
                                          output_final_state=True, **extra)
    return o


def _reference(case, x):
    o, _ = reference.chunked(x["q"], x["k"], x["v"], g=x.get("g"), beta=x.get("beta"),
                             initial_state=x["initial_state"])
    return o


def cost(case):
    p = case.params
    T, H, K, V, C, level = p["T"], p["H"], p["K"], p["V"], CHUNK, p["level"]
    gate_bytes = {1: 0, 2: T * H * 4, 3: T * H * K * 4, 4: T * H * 4}[level]
    nbytes = 2 * T * H * K * 2 + 2 * T * H * V * 2 + gate_bytes + 2 * H * K * V * 4
    per_chunk = 2 * C * K * V * 2 + 2 * C * C * (K + V)
    if level == 4:
        per_chunk += 2 * C * C * K + 2 * C * K * V + 2 * C * C * V
    return {"bytes": nbytes, "flops": -(-T // C) * H * per_chunk}


BENCH = Bench(
    op="ladder",
    cases=cases,
    check_cases=[_case(level, 512, 2) for level in LEVELS],
    make_inputs=make_inputs,
    impls={"tilela": _ours, "tilela_unsplit": _ours_unsplit, "fla": _fla, "tilela_seq_in_grid": _ours_seq_in_grid},
    reference=_reference,
    cost=cost,
)
