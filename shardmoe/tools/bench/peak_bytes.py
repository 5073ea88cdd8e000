"""The peak of the bytes one step allocates, from the profiler's memory events.

Saved bytes (saved_bytes.py) count what a forward keeps for its backward; they miss the scratch
a step allocates and frees on the way (transformers' expert buffers, gradients of activations),
while a workspace keeps its scratch between steps and shows it whole. The fair comparison of the
two is the step's peak:

  peak = max over time of (bytes allocated - bytes freed since the step began)

read off the CPU allocator's events that torch.profiler records with profile_memory=True, in time
order. Weights, inputs and a workspace's blocks exist before the step and are not in it; the
caller adds the blocks (peak_with_pools). Gradients the step leaves behind (.grad) are in it,
for every candidate alike. The events counted are those of the thread that runs the step (all
241 of a profiled e8 bf16 step of the layer came from it); whatever an op might allocate on its
intra-op worker threads is not in the figure.
"""
from __future__ import annotations

MEMORY_EVENT = "[memory]"  # the name torch's profiler gives allocator events


def step_peak_bytes(step, reset=None) -> int:
    """Peak bytes live during step() above what was live when it began (>= 0). reset(), run first
    and outside the profile, drops the last step's gradients: freed inside it, blocks allocated
    before the profile began would go unseen, and blocks allocated in an earlier profile seen."""
    import gc
    import os

    from torch.profiler import ProfilerActivity, profile

    # kineto writes "profiler_start"/"profiler_stop" lines (level 5) to stderr on every profile;
    # read on its first use, so set here unless the user chose a level
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    if reset is not None:
        reset()
    # earlier steps' garbage in reference cycles would otherwise be freed wherever the collector
    # happens to run inside this step, moving the peak from run to run
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        if enabled:
            gc.enable()
    # the per-allocation events; prof.events() folds them into the ops that made them
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == MEMORY_EVENT]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def peak_with_pools(step, reset, pools=(), attempts: int = 3) -> int:
    """step_peak_bytes(step, reset) plus the resident bytes of the workspaces `pools`, from a step
    in which no pool grew: a block allocated inside the step would be counted twice, and the blocks
    a pool drops are freed outside the profiler's view. Raises RuntimeError when a pool still grows
    after `attempts` tries."""
    pools = list(pools)
    for _ in range(attempts):
        resident = [pool.resident_bytes for pool in pools]
        peak = step_peak_bytes(step, reset)
        if [pool.resident_bytes for pool in pools] == resident:
            return peak + sum(resident)
    raise RuntimeError(f"workspace: still growing after {attempts} measured steps "
                       f"({sum(resident)} -> {sum(p.resident_bytes for p in pools)} bytes); warm the step up first")
