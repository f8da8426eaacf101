"""mpishard: distributed training and inference on MPI, every strategy written by hand.

    import mpishard as ms
    model = ms.MLP(dims=[784, 512, 256, 10], activation="relu")
    engine = ms.make_engine(model, "dp=2,tp=2", dtype=np.float64)
    engine.load_checkpoint(model.init(seed=0))
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), ms.losses.MSE())
"""
from . import checkpoint, nn
from .nn import losses
from .train import data, optim, trainer
from .engine import CollectiveMismatchError, Future, ShardedEngine
from .comm.mesh import DeviceMesh, Layout, parse_layout
from .nn.models import MLP, MoE
from .parallel import MeshEngine, SingleDevice, make_engine

__version__ = "0.1.0"

__all__ = ["MLP", "MoE", "ShardedEngine", "MeshEngine", "SingleDevice", "DeviceMesh", "Layout",
           "CollectiveMismatchError", "Future", "make_engine", "parse_layout", "losses", "nn",
           "checkpoint", "data", "optim", "trainer",
           "__version__"]
