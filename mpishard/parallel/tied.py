"""Tied embeddings under pp (Megatron): one parameter, a copy on the first and last stage.

A tied model's head reuses the token embedding E = embed/tokens (TiedHead: logits = h E^T).
Under pp the embedding runs on the first stage and the head on the last, so, as Megatron
does, both stages hold E (the placement's `tied_stages` names the last one) and the copies are
kept equal:

    forward    E_first = E_last = E                    each stage reads its own copy (a
                                                       broadcast of E, done by loading)
    backward   dL/dE = dL/dE_first + dL/dE_last         its adjoint: the sum over the copies

The sum is one exchange between the two stage ranks of every (dp, fsdp, cp, tp) coordinate,
the all-reduce of that pair: each sends its gradient block and adds the block it receives.
a + b and b + a are the same float, so both copies get the same gradient and, from the same
optimizer state, the same update: they stay equal bit for bit. It travels over the pp
communicator (the pair is its first and last rank) as tagged point-to-point messages, bounded
by the watchdog like every receive: a sub-communicator of the pair would share the pp
group's arrival counter (health/watchdog.py counts per set of axes), so the middle stages,
which take no part, would be named late after any later pp timeout.

It runs in the engine's gradient sync, after fsdp's reduce-scatter and the dp average
(`TiedGradientSync` wraps the GradientSync), on the gradient blocks as they are then: whole,
the vocab shard of a tp rank, or the fsdp/ZeRO slice. Summing the slices is exact: both stages
cut E the same way (one placement), fsdp's average is linear, and a slice is 1/fsdp of the
bytes a sum before the reduce-scatter would move. Gradient accumulation (sync=False) sums at
the sync that ends it.

What sees one parameter: gather_params / gather_grads (from the first stage: the summed
gradient), checkpoints (the writer keeps one block per region, so one embed/tokens; a restore
or load_checkpoint fills every copy, so pp <-> non-pp resharding needs nothing), and norms
(ParamStore.replication counts the copies once). The rule is generic: any spec with
`tied=True` whose head (on the last stage) reuses embed/tokens (the first stage's).
"""
from __future__ import annotations

TIED_NAME = "embed/tokens"
TAG = 1 << 12      # message tags TAG + i, i = the tied parameter's index (no pipeline traffic
                   # is in flight between two syncs: every step receives what it was sent)


def tied_stages(tied: bool, name: str, param_stage: int, head_stage: int) -> tuple:
    """The other pp stages holding a copy of parameter `name`: the head's stage for a tied
    model's (`tied`) embed/tokens when it is not the embedding's own, else ()."""
    if tied and name == TIED_NAME and head_stage != param_stage:
        return (head_stage,)
    return ()


class TiedGradientSync:
    """A GradientSync whose `sync` also sums the tied copies' gradients (module docstring).

    inner: the GradientSync; pp: the Comm of this rank's pp group; peers: name -> the pp
    rank holding this rank's other copy of it (the same order on both ranks)."""

    def __init__(self, inner, pp, peers: dict):
        self.inner, self.pp, self.peers = inner, pp, dict(peers)

    def __getattr__(self, attr):            # begin, on_load, on_grad_ready, buckets, ...
        return getattr(self.inner, attr)

    def sync(self, grads: dict) -> None:
        """The data-parallel sync, then each tied gradient := its sum over the two copies."""
        self.inner.sync(grads)
        coming = [self.pp.receive_async(peer, tag=TAG + i)
                  for i, peer in enumerate(self.peers.values())]
        sent = [self.pp.send_async(grads[name], peer, tag=TAG + i)    # adjoint of the copy
                for i, (name, peer) in enumerate(self.peers.items())]
        theirs = [future.result() for future in coming]
        for future in sent:                 # grads[name] is read by its send until done
            future.result()
        for name, other in zip(self.peers, theirs):
            grads[name] += other            # mine + theirs on both ranks: the same float


def tie_gradients(grad_sync, plan: dict, pp, stage: int):
    """grad_sync, wrapped to sum the gradients of the tied parameters this rank holds (plan:
    name -> ParamInfo; pp: the pp group's Comm; stage: this rank's pp coordinate)."""
    peers = {}
    for name, info in plan.items():
        stages = info.placement.stages
        if len(stages) > 1 and stage in stages:
            if len(stages) != 2:
                raise ValueError(f"{name}: tied copies on stages {stages}; only a pair (the "
                                 f"first and the last stage) is supported")
            peers[name] = stages[1] if stage == stages[0] else stages[0]
    return TiedGradientSync(grad_sync, pp, peers) if peers else grad_sync


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def memory(view, n_state) -> dict:
    """Nothing beyond the base: a tied copy is one of the rank's parameter blocks."""
    return {}


def step_comm(view) -> dict:
    """The exchange above: each tied gradient block this rank holds, sent once per step."""
    sent = sum(view.nbytes(shape) for name, shape in view.grad_blocks.items()
               if len(view.params[name].placement.stages) > 1)
    return {"train_step": {"send": sent}} if sent else {}
