"""A Hugging Face directory is untrusted input: the shards its model.safetensors.index.json
names are plain file names inside it (train/untrusted.file_in), a safetensors header that does
not match its file is a ValueError naming the file, and the lazily read tensors (SafeTensor,
Mixtral's stacked and fused expert views) index as hfmap.views.region_of reads a key:
steps honoured, never dropped.

No torch here: the directories are written by ms.hf.save from a spec's own init.
"""
import hashlib
import json
import os
import struct

import numpy as np
import pytest

import mpishard as ms
from mpishard.hf.files import INDEX, SINGLE, HFDir, SafeTensor
from mpishard.models.llama import hf_mixtral as mixtral

safetensors = pytest.importorskip("safetensors")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

KEYS = [np.s_[...], np.s_[::2], np.s_[1:7:3, ::-1], np.s_[-1], np.s_[:, 5], np.s_[::-2, 1:3],
        np.s_[2:2], np.s_[..., 3:0:-1]]


def _gpt2(directory):
    model = ms.GPT(vocab_size=13, seq_len=8, d_model=8, n_heads=2, n_layers=1, tied=False)
    return ms.hf.save(directory, model, model.init(seed=3), dtype="float64")


def _shard(directory):
    """Split model.safetensors into two shards named by an index: (directory, weight_map)."""
    tensors = safetensors_numpy.load_file(os.path.join(directory, SINGLE))
    keys = sorted(tensors)
    weight_map = {k: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    for name in set(weight_map.values()):
        safetensors_numpy.save_file({k: tensors[k] for k in keys if weight_map[k] == name},
                                    os.path.join(directory, name), metadata={"format": "pt"})
    os.remove(os.path.join(directory, SINGLE))
    return weight_map


def _write_index(directory, weight_map):
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("how", ["relative", "absolute", "dotdot"])
def test_a_shard_outside_the_directory_is_refused(tmp_path, how):
    d = _gpt2(tmp_path / "m")
    weight_map = _shard(d)
    victim = sorted(weight_map)[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.replace(os.path.join(d, weight_map[victim]), elsewhere / "secret.safetensors")
    name = {"relative": "../elsewhere/secret.safetensors", "dotdot": "..",
            "absolute": str(elsewhere / "secret.safetensors")}[how]
    moved = {k: name for k, v in weight_map.items() if v == weight_map[victim]}
    _write_index(d, dict(weight_map, **moved))
    with pytest.raises(ValueError, match=(
            rf"model.safetensors.index.json: weight_map '{sorted(moved)[0]}' file '{name}' is "
            rf"not a plain file name inside {d} \(")):
        ms.hf.load(d)


def _as_hub_cache(directory, cache):
    """Move every file of model `directory` into the shape `huggingface_hub` downloads to:
    cache/models--test--tiny/blobs/<sha256> and snapshots/<rev>/<name> -> ../../blobs/<sha256>
    (refs/main names the revision). Returns the snapshot directory."""
    repo, rev = cache / "models--test--tiny", "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(directory)):
        data = open(os.path.join(directory, name), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        os.replace(os.path.join(directory, name), repo / "blobs" / blob)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    os.rmdir(directory)
    return snapshot


@pytest.mark.parametrize("sharded", [False, True])
def test_a_model_in_the_hub_cache_loads(tmp_path, sharded):
    """snapshot_download's directory, every file a symlink to ../../blobs/<sha>: the names are
    plain, so config.json, the index and each shard are read through their links, and the
    weights are the model's own."""
    d = _gpt2(tmp_path / "m")
    spec, want = ms.hf.load(d)
    if sharded:
        _write_index(d, _shard(d))
    snapshot = _as_hub_cache(d, tmp_path / "hub")
    assert all(os.path.islink(snapshot / n) for n in os.listdir(snapshot))
    assert (INDEX in os.listdir(snapshot)) == sharded
    got_spec, got = ms.hf.load(str(snapshot))
    assert repr(got_spec) == repr(spec)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_the_sharded_directory_itself_loads(tmp_path):
    d = _gpt2(tmp_path / "m")
    _, want = ms.hf.load(d)
    _write_index(d, _shard(d))
    _, got = ms.hf.load(d)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _rewrite_header(path, change):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


@pytest.mark.parametrize("change", [
    lambda h: h["transformer.wte.weight"].update(shape=[13000, 8]),      # past the file's end
    lambda h: h["transformer.wte.weight"].update(shape=[2**40, 2**40]),  # absurd
    lambda h: h["transformer.wte.weight"].update(data_offsets=[0, 10**9]),
])
def test_a_safetensors_header_that_does_not_match_its_file_is_a_value_error(tmp_path, change):
    d = _gpt2(tmp_path / "m")
    _rewrite_header(os.path.join(d, SINGLE), change)
    with pytest.raises(ValueError, match=rf"{d}/model.safetensors is not a valid safetensors "
                                         rf"file: .*header"):
        ms.hf.load(d)


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_a_safetensor_indexes_like_numpy_in_both_orientations(tmp_path, key):
    d = _gpt2(tmp_path / "m")
    _, params = ms.hf.load(d)
    with HFDir(d).tensors() as files:
        plain = files["transformer.h.0.mlp.c_fc.weight"]           # (D, F), not transposed
        head = files["lm_head.weight"].T()                          # (V, D) seen as (D, V)
        for tensor, want in ((plain, params["block_0/mlp/fc/weights"]),
                             (head, params["head/weights"])):
            assert np.array_equal(tensor[key], want[key]), (tensor, key)


@pytest.fixture
def experts(tmp_path):
    """A Mixtral's per-expert files, and one fused (E, 2F, D) tensor, with the numpy arrays
    our views must equal: (files of the per-expert directory, stacked view, its array, fused
    view, its array)."""
    model = ms.Llama(vocab_size=11, seq_len=8, d_model=8, n_heads=2, n_layers=1, d_ff=6,
                     n_experts=5, top_k=2)
    params = model.init(seed=4)
    d = ms.hf.save(tmp_path / "mixtral", model, params, dtype="float64")
    rng = np.random.default_rng(0)
    fused = rng.standard_normal((5, 12, 8))                         # (E, 2F, D)
    safetensors_numpy.save_file({"fused": fused}, str(tmp_path / "fused.safetensors"))
    return d, model, params, str(tmp_path / "fused.safetensors"), fused


@pytest.mark.parametrize("key", KEYS + [np.s_[::2, 1:7:3, ::-2], np.s_[4:0:-2, ..., 1]],
                         ids=str)
def test_expert_views_honour_a_step(experts, key):
    d, model, params, fused_file, fused = experts
    stacked = mixtral.name_map(model)["block_0/moe/experts/up/weights"]
    with HFDir(d).tensors() as files:
        view = stacked.view(files)
        assert np.array_equal(view[key], params["block_0/moe/experts/up/weights"][key]), key
    with safetensors.safe_open(fused_file, framework="np") as h:
        tensor = SafeTensor(h, "fused", {"bytes": 0})
        up = mixtral.Fused("fused", 6, 12).view({"fused": tensor})     # rows F:2F, (E, D, F)
        assert np.array_equal(up[key], fused[:, 6:12, :].transpose(0, 2, 1)[key]), key
