"""Ahead-of-time compilation of the Hopper kernels: ``tilela precompile`` and ``tilela.warmup``.

A first call of an op on a Hopper GPU compiles its TileLang kernels (tens of seconds each); TileLang keeps them in
its on-disk cache (TILELANG_CACHE_DIR), so a process that finds them there loads them instead. This module compiles
them beforehand, on any machine with TileLang and nvcc (no GPU needed: the target is sm_90a):

  - kkt_solve, chunk_local_cumsum, gla_factors, seq_combine, l2norm: every configuration we ship
    (kernels.hopper.CUMSUM_CONFIGS, KKT_CONFIGS, GLA_FACTORS_CONFIGS, SEQ_COMBINE_CONFIGS, L2NORM_CONFIGS);
  - the state/output passes of every attention op at K = V in {64, 128, 256}, bf16 and fp16, with the (varlen,
    initial state, final state) switches the GPU tests and benchmarks use: GDN in both passes (and its
    half-precision beta), KDA in both and on the loop pass at chunk 16 too (its short-chunk path), the other ops in
    the pass that serves them, the warp-specialised pass at every DV block
    it is built for (plan.dv_blocks) and the sequence split's transitions and, for GDN, its outputs pass under the
    warm-up.

Each `Job` records which public ops call its kernel (an attention op uses the 64-token chunk's cumsum and blocked
kkt_solve; KDA's short-chunk path the 16-token chunk's and the Neumann one), its q/k dtype and K where it has them,
so a serving process compiles only what its ops, dtypes and head dims need.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Iterable, Iterator, NamedTuple

from .check import ATTENTION_OPS, PRIMITIVES

# short names --ops takes besides the public op names
ALIASES = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "delta_rule": "chunk_delta_rule",
           "linear_attn": "chunk_linear_attn", "simple_gla": "chunk_simple_gla", "gla": "chunk_gla"}


class Job(NamedTuple):
    kind: str  # "cumsum", "kkt", "gla", "combine", "l2norm", "chunk_fwd" or "ws"
    config: tuple  # the kernel builder's static arguments (compile_one)
    ops: frozenset[str]  # the public ops that call this kernel
    dtype: str | None = None  # q/k dtype, where the kernel has one
    K: int | None = None  # key head dim, where the kernel has a static one


class Result(NamedTuple):
    job: Job
    seconds: float
    error: str | None


def jobs() -> list[Job]:
    """Every kernel configuration this module compiles (see the module docstring)."""
    from .kernels.hopper import CUMSUM_CONFIGS, GLA_FACTORS_CONFIGS, KKT_CONFIGS, L2NORM_CONFIGS, SEQ_COMBINE_CONFIGS
    from .kernels.hopper.plan import CHUNK as TILE
    from .kernels.hopper.plan import SHORT_CHUNK, covers, dv_blocks, warms, ws_covers

    op_of = {level: op for op, level in ATTENTION_OPS.items()}
    gated = frozenset(op for op, (gate, _) in ATTENTION_OPS.items() if gate != "none")
    gdn, kda = op_of["scalar", True], op_of["channel", True]  # GDN's kkt_solve sums the gate (no cumsum stage)
    log_cumsum_ops = {SHORT_CHUNK: {kda}, TILE: gated - {gdn}}  # by chunk (16: KDA's short-chunk path)
    out = [Job("cumsum", c, frozenset({"chunk_local_cumsum"}) | log_cumsum_ops.get(c[0], set()) if c[2] == "log"
               else frozenset({kda})) for c in CUMSUM_CONFIGS]
    # kkt_solve: GDN's sums the raw gate (Ab for the warp-specialised pass, A for the loop pass); the others read
    # gc, Ab (scaled) for delta_rule's warp-specialised pass (GDN's on a given gc: tests and benchmarks), A for the
    # public op, delta_rule's and KDA's loop passes
    def kkt_ops(c):
        if c[5]:
            return frozenset({gdn})
        if c[6]:
            return frozenset() if c[3] == "scalar" else frozenset({op_of[c[3], True]})
        return frozenset({"kkt_solve"} | ({op_of[c[3], True]} if c[:2] == (TILE, "blocked") and c[3] != "scalar"
                                         else set())
                         | ({kda} if (c[0], c[1], c[3]) == (SHORT_CHUNK, "neumann", "channel") else set()))
    out += [Job("kkt", c, kkt_ops(c), dtype=c[2]) for c in KKT_CONFIGS]
    out += [Job("gla", c, frozenset({op_of["channel", c[3]]}), dtype=c[1], K=c[0]) for c in GLA_FACTORS_CONFIGS]
    # by (transition, warm-up): the plain update's gate kinds, the delta rule's [B | M] (GDN's under the warm-up)
    combine_ops = {("none", False): {op_of["none", False]}, ("scalar", False): {op_of["scalar", False]},
                   ("matrix", False): {op_of["none", True], op_of["channel", True]},
                   ("matrix", True): {op_of["scalar", True]}}
    out += [Job("combine", c, frozenset(combine_ops[c[2], c[4]]), K=c[0]) for c in SEQ_COMBINE_CONFIGS]
    l2norm_ops = frozenset(op for op, (_, delta) in ATTENTION_OPS.items() if delta)  # use_qk_l2norm_in_kernel
    out += [Job("l2norm", c, l2norm_ops, dtype=c[1], K=c[0]) for c in L2NORM_CONFIGS]
    switches = [(True, True, True), (False, False, True), (False, True, True), (True, False, True),
                (False, False, False), (True, True, False)]
    for (gate, delta), K, dtype, flags in itertools.product(ATTENTION_OPS.values(), (128, 64, 256),
                                                            ("bfloat16", "float16"), switches):
        level = dict(ops=frozenset({op_of[gate, delta]}), dtype=dtype, K=K)
        for beta_dtype in ("float32", dtype) if gate == "scalar" and delta else ("float32",):
            if covers(dtype, K, K, gate, delta) and (
                    gate == "channel" or K == 256 or (gate, delta) == ("scalar", True)):
                out += [Job("chunk_fwd", (K, gate, delta, dtype, beta_dtype, flags, chunk), **level)
                        for chunk in (TILE, SHORT_CHUNK)[:1 + ((gate, delta) == ("channel", True))]]
            if ws_covers(dtype, K, K, gate, delta):  # what "auto" picks
                out += [Job("ws", (K, K, gate, delta, dtype, beta_dtype, flags, block_DV, True, False), **level)
                        for block_DV in dv_blocks(K, gate, delta)]
                if (gate, delta, K) == ("scalar", True, 128):  # GDN's unsplit pass at DV 128, its output folded
                    out.append(Job("ws", (K, K, gate, delta, dtype, beta_dtype, flags, K, True, False, True), **level))
                if warms(gate, delta) and flags[:2] == (True, True):  # the split's outputs under the warm-up
                    out += [Job("ws", (K, K, gate, delta, dtype, beta_dtype, flags, block_DV, True, True), **level)
                            for block_DV in dv_blocks(K)]
                # the state pass alone: the sequence split's transitions (varlen, final states; the delta rule's
                # on [V | 0] from [0 | I], both formed in the pass, under GDN's warm-up; V from zero without) and
                # the state_pass bench's state_only (V, from an initial state with the delta rule; not KDA's)
                alone = [(K, (True, delta, True))] * (gate != "channel") + [(2 * K, (True, False, True))] * delta
                out += [Job("ws", (K, V, gate, delta, dtype, beta_dtype, flags, block_DV, False,
                                   warms(gate, delta) and V == 2 * K), **level)
                        for V, wanted in alone if flags == wanted for block_DV in dv_blocks(K, gate, delta)]
    return out


def plan_jobs(plan) -> list[Job]:
    """The kernels one Hopper plan (kernels.hopper.plan.Plan) launches, as Jobs (ops left empty): its cumsum,
    kkt_solve, gla_factors, state passes and combine; so the kernels of a
    given call compile ahead of a device run (benchmarks/precompile.py's cases=), a candidate's own included."""
    out = [Job(kind, key, frozenset()) for kind, key in (("cumsum", plan.cumsum), ("kkt", plan.kkt),
                                                         ("gla", plan.factors), ("combine", plan.combine)) if key]
    for cfg in plan.passes:
        flags = (cfg.is_varlen, cfg.use_initial_state, cfg.store_final_state)
        config = (cfg.K, cfg.V, cfg.gate, cfg.delta, cfg.dtype, cfg.beta_dtype, flags, *cfg.tiles) \
            if cfg.kernel == "ws" else (cfg.K, cfg.gate, cfg.delta, cfg.dtype, cfg.beta_dtype, flags, cfg.tiles[3])
        out.append(Job("ws" if cfg.kernel == "ws" else "chunk_fwd", config, frozenset()))
    return list(dict.fromkeys(out))


def public_op(name: str) -> str:
    """The public op a --ops name means (a public op name or one of ALIASES)."""
    known = [*ATTENTION_OPS, *PRIMITIVES]
    if name in known:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"ops: expected names among {sorted(ALIASES) + known}, got {name!r}")


def select(ops: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
           head_dims: Iterable[int] | None = None) -> list[Job]:
    """The jobs() that ops (public names or ALIASES; None: all) call with q/k in one of dtypes ("bfloat16",
    "float16", or torch dtypes; None: both) at K in head_dims (None: every K)."""
    every = jobs()
    wanted = None if ops is None else {public_op(name) for name in ops}
    dtypes = None if dtypes is None else {str(d).removeprefix("torch.") for d in dtypes}
    head_dims = None if head_dims is None else set(head_dims)
    for name, given, known in (("dtypes", dtypes, {j.dtype for j in every}), ("head_dims", head_dims,
                                                                              {j.K for j in every})):
        unknown = sorted(given - known) if given is not None else []
        if unknown:
            raise ValueError(f"{name}: expected values among {sorted(k for k in known if k is not None)}, "
                             f"got {unknown}")
    return [j for j in every if (wanted is None or j.ops & wanted)
            and (dtypes is None or j.dtype is None or j.dtype in dtypes)
            and (head_dims is None or j.K is None or j.K in head_dims)]


def unavailable() -> str | None:
    """Why the kernels cannot be compiled here, as one line, or None when TileLang and nvcc are present."""
    from .info import _tilelang, nvcc_version

    tilelang, error = _tilelang()
    if tilelang is None:
        return f"needs TileLang (pip install tilelang==0.1.15), which does not import here: {error}"
    if nvcc_version() is None:
        return "needs the CUDA compiler nvcc, which TileLang does not find here: put it on PATH or set CUDA_HOME"
    return None


def compile_one(job: Job) -> Result:
    """Compile one kernel (kernels.hopper.launch.compiled: into this process's memory and TileLang's disk cache); a
    failure is returned, not raised."""
    from .kernels.hopper import launch
    from .kernels.hopper.plan import PassConfig, loop_tiles

    t = time.perf_counter()
    try:
        if job.kind in ("chunk_fwd", "ws"):
            if job.kind == "chunk_fwd":
                K, gate, delta, dtype, beta_dtype, flags, chunk = job.config
                V, tiles = K, loop_tiles(K, gate, delta, dtype, chunk)
            else:
                K, V, gate, delta, dtype, beta_dtype, flags, *tiles = job.config  # PassConfig's ws tiles
            kernel = "loop" if job.kind == "chunk_fwd" else "ws"
            cfg = PassConfig(kernel, K, V, float(K) ** -0.5, gate, delta, dtype, beta_dtype, *flags, tuple(tiles))
            launch.compiled(launch.STATE_PASSES[kernel], *cfg.args, warp_specialized=True)
        else:
            builder = {"kkt": launch.kkt_solve_kernel, "cumsum": launch.chunk_local_cumsum_kernel,
                       "gla": launch.gla_factors_kernel, "combine": launch.seq_combine_kernel,
                       "l2norm": launch.l2norm_kernel}[job.kind]
            launch.compiled(builder, *job.config)
        return Result(job, time.perf_counter() - t, None)
    except Exception as exc:  # noqa: BLE001 - reported per job: one failing kernel must not stop the others
        return Result(job, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[:300]}")


def compile_jobs(todo: list[Job], processes: int = 1) -> Iterator[Result]:
    """Compile todo, yielding each Result as it finishes: in this process for processes == 1 (the kernels are then
    in this process's memory too), else in that many fresh worker processes (they fill TileLang's disk cache, which
    a later first call loads from)."""
    if processes == 1:
        yield from map(compile_one, todo)
        return
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(compile_one, job) for job in todo]):
            yield future.result()


def warmup(ops: Iterable[str] | None = None, *, dtypes: Iterable | None = None, head_dims: Iterable[int] | None = None,
           processes: int = 1, progress: bool | None = None) -> list[Result]:
    """Compile the Hopper kernels that ops (public op names or "gdn", "kda", ...; None: every op) use with q/k in
    dtypes (None: bf16 and fp16) at K in head_dims (None: 64, 128, 256), so that their first calls load them
    instead of compiling. processes: worker processes (1: compile in this process, which then holds the kernels
    in memory). progress: show a progress line on stderr (None: when stderr is a terminal).

    Raises RuntimeError when TileLang or nvcc is missing, or when a kernel fails to compile (after trying all);
    returns each kernel's Result otherwise."""
    from ._progress import Progress

    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes: expected an int >= 1, got {processes!r}")
    todo = select(ops, dtypes, head_dims)
    problem = unavailable()
    if problem is not None:
        raise RuntimeError(problem)
    results = []
    with Progress("warmup", total=len(todo), enabled=progress) as bar:
        for result in compile_jobs(todo, processes):
            results.append(result)
            bar.update(result.job.kind)
            bar.advance()
    failed = [r for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} kernels failed to compile, first {failed[0].job.kind} "
                           f"{failed[0].job.config}: {failed[0].error}")
    return results
