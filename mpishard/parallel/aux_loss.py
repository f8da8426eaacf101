"""A model's auxiliary loss in the training step: runners that add it to the loss value.

A model whose units collect an auxiliary loss during the forward (a Mixtral's load-balancing
loss: models/llama/experts.AuxLoss) hands compose an `aux` hook with begin(grad_scale),
end(), total() (the collective that ends the forward's collection and returns the value) and
`active`. The runners here call it around each train_step: AuxLossRunner for pp=1,
AuxLossPipeline under a pipeline (schedule=gpipe: every forward of the step runs before the
first backward, so the collection is whole when a stage's first backward starts).

token_axes: the axes over which ranks hold different tokens, the group such a loss (and its
routing statistics) is summed over.
"""
from __future__ import annotations

from ..comm.mesh import DATA_AXES
from ..nn.losses import step_pair


def token_axes(layout) -> tuple:
    """The axes over which ranks hold different tokens: the data axes, cp, and tp under
    sequence_parallel (those of size > 1)."""
    sp = layout.size("tp") > 1 and layout.option("sequence_parallel", 0)
    axes = DATA_AXES + ("cp",) + (("tp",) if sp else ())
    return tuple(a for a in axes if layout.size(a) > 1)


class AuxLossRunner:
    """The runner (Sequential: pp=1) with the auxiliary loss c aux added to each train_step's
    loss value, the step's grad_scale given to the hook. forward, backward and the tracer are
    the runner's."""

    def __init__(self, runner, aux):
        self.runner, self.aux = runner, aux

    @property
    def tracer(self):
        return self.runner.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:        # a trace (parallel/tracing.py) sets it
        self.runner.tracer = tracer

    def forward(self, x, mb=0, record=True):
        return self.runner.forward(x, mb=mb, record=record)

    def backward(self, dy, mb=0):
        return self.runner.backward(dy, mb=mb)

    def train_step(self, x, t, loss, grad_scale):
        self.aux.begin(grad_scale)
        try:
            return self.runner.train_step(x, t, WithAux(loss, self.aux), grad_scale)
        finally:
            self.aux.end()


class WithAux:
    """`loss` with c aux added to its value (the hook's total, the collective that ends the
    forward's collection). step_pair calls its `pair` with the step's gradient scale, which
    it hands on to the loss's own (so a 16-bit step's logits reach the loss as they are)."""

    def __init__(self, loss, aux):
        self.loss, self.aux = loss, aux

    def pair(self, y, t, scale=None):
        value, dy = step_pair(self.loss, y, t, scale)
        return value + self.aux.total(), dy

    __call__ = pair


class AuxLossPipeline(AuxLossRunner):
    """The PipelineRunner (schedule=gpipe: the model's layout check) with c aux. Its
    before_action hook, set once here, ends the collection at the rank's first action of a
    step that is not a forward (every forward of the step on this stage done; its sends are
    non-blocking, so every stage reaches the all_reduce, over pp and the token axes, before
    any waits for a gradient); c aux joins the last stage's loss value (the one the engine
    broadcasts over pp). inference_loop is the runner's."""

    def __init__(self, runner, aux):
        super().__init__(runner, aux)
        self.value = 0.0                     # this step's c aux, once the hook has run
        runner.before_action = self._end_forwards

    def _end_forwards(self, action) -> None:
        if action.kind != "F" and self.aux.active:
            self.value = self.aux.total()

    def inference_loop(self, input_stream, output_stream, prepare=None):
        return self.runner.inference_loop(input_stream, output_stream, prepare=prepare)

    def train_step(self, x, t, loss, grad_scale):
        self.value = 0.0
        self.aux.begin(grad_scale)
        try:
            value, rows = self.runner.train_step(x, t, loss, grad_scale)
        finally:
            self.aux.end()
        last = self.runner.stage == self.runner.pp - 1
        return value + (self.value if last else 0.0), rows
