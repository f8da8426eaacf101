"""mpishard: distributed training and inference on MPI, every strategy written by hand.

    import mpishard as ms
    model = ms.MLP(dims=[784, 512, 256, 10], activation="relu")
    engine = ms.make_engine(model, "dp=2,tp=2", dtype=np.float64)
    engine.load_checkpoint(model.init(seed=0))
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), ms.losses.MSE())
"""
from . import checkpoint, hf, nn
from .comm.mesh import CommUnusable, DeviceMesh, Layout, parse_layout
from .comm.p2p import Future
from .engine import MeshEngine, ShardedEngine, SingleDevice, make_engine
from .health.debug import CollectiveMismatchError
from .health.watchdog import CollectiveTimeout
from .nn import losses
from .models import GPT, MLP, Llama, MoE, Mixtral, Qwen2
from .train import data, optim, trainer

__version__ = "0.1.0"

__all__ = ["GPT", "Llama", "Mixtral", "MLP", "MoE", "Qwen2", "ShardedEngine", "MeshEngine",
           "SingleDevice", "DeviceMesh",
           "Layout", "CollectiveMismatchError", "CollectiveTimeout", "CommUnusable", "Future",
           "make_engine",
           "parse_layout",
           "losses", "nn", "checkpoint", "hf", "data", "optim", "trainer",
           "__version__"]
