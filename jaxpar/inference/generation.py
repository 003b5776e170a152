"""Text generation: prefill the prompts, then decode one token at a time with a KV cache.

The model is the training model, run as it is: the cache enters through the attention hook
(:attr:`jaxpar.model.annotate.Layout.attention`), one slice per scanned unit of layers. Prefill
compiles once per (B, S, L) and the decode step once per (B, L), lengths rounded up to
:data:`LENGTH_BUCKET`. How it works, memory and compiles: docs/generation.md, "How it works".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.config import BATCH_AXES, Config, ConfigError, ModelConfig
from jaxpar.model.annotate import Attention, layout_with
from jaxpar.model.attention import dense_attention
from jaxpar.model.fused import attention_fn, resolve
from jaxpar.model.kv_cache import KVCache, UnitCache, cache_axes, model_cache
from jaxpar.model.lora import merged_weights
from jaxpar.model.transformer import (
    DTYPES,
    Transformer,
    abstract_model,
    complete_buffers,
    dense_units,
    layer_units,
)
from jaxpar.model.vocab import fit_vocab
from jaxpar.parallel.hooks import model_hooks
from jaxpar.parallel.rules import (
    logical_rules,
    model_specs,
    named_shardings,
    param_name,
    resolve_spec,
)

LENGTH_BUCKET = 16  # prompt and cache lengths are rounded up to a multiple of this
SUPPORTED_AXES = ("data", "fsdp", "tensor")  # mesh axes generation may split over
EosIds = int | Sequence[int] | None  # what ends a row: no id, one, or any of several


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 = no cut)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1] (1 = no cut)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample(logits: jax.Array, key: jax.Array, step: jax.Array, sampling: Sampling
           ) -> jax.Array:
    """float32 logits [B, V] -> int32 tokens [B] (module docstring: Sampling)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    # Sorted once (descending) for both cuts; the vocabulary is small next to the model.
    ranked = -jnp.sort(-logits, axis=-1)
    if sampling.top_k:
        kth = ranked[:, min(sampling.top_k, logits.shape[-1]) - 1]
        logits = jnp.where(logits < kth[:, None], -jnp.inf, logits)
        ranked = jnp.where(ranked < kth[:, None], -jnp.inf, ranked)
    if sampling.top_p < 1:
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
        # The lowest logit still kept: a token stays when the better ones reach < top_p.
        floor = jnp.min(jnp.where(before < sampling.top_p, ranked, jnp.inf), axis=-1)
        logits = jnp.where(logits < floor[:, None], -jnp.inf, logits)
    step_key = jax.random.fold_in(key, step)
    row_keys = jax.vmap(lambda b: jax.random.fold_in(step_key, b))(
        jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(row_keys, logits).astype(jnp.int32)


def forward_cached(model: Transformer, tokens: jax.Array, positions: jax.Array,
                   cache: KVCache, dtype: Any, prefill: Attention = dense_attention
                   ) -> tuple[jax.Array, KVCache]:
    """The model on ``tokens`` [B, S] at ``positions`` [B, S], attending over and writing into
    ``cache``: (residual stream before the final norm [B, S, E], the updated cache).

    The layers are scanned as :meth:`Transformer.run_layers` does, with each unit's slice of
    the cache ([blocks per unit, B, L, K, D]) scanned beside its parameters. With S > 1 (a
    prefill from position 0) the queries attend to the new keys by ``prefill``."""
    x = model.embed(tokens, dtype=dtype)
    # DeepSeek-V3's dense first blocks (a stack of their own) own the first layers' slices.
    first = dense_units(model.cfg)
    stacks = [(model.dense_layers, first)] if first else []
    stacks.append((model.layers, layer_units(model.cfg)))
    ks, vs, start = [], [], 0
    for stack, units in stacks:
        layers = first if stack is not model.layers else cache.k.shape[0] - first
        x, k, v = _scan_cached(stack, units, x, positions, cache.k[start:start + layers],
                               cache.v[start:start + layers], prefill)
        ks.append(k)
        vs.append(v)
        start += layers
    if len(ks) == 1:
        return x, KVCache(ks[0], vs[0])
    return x, KVCache(jnp.concatenate(ks), jnp.concatenate(vs))


def _scan_cached(stack: nnx.Module, units: int, x: jax.Array, positions: jax.Array,
                 k: jax.Array, v: jax.Array, prefill: Attention
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One stack of layers scanned over its ``units`` units, each with its slice of the
    stack's cache ``k``, ``v`` [layers, ...]: x and the stack's updated cache."""
    graphdef, stacked = nnx.split(stack)

    def per_unit(a: jax.Array) -> jax.Array:  # [layers, ...] -> [units, blocks, ...]
        return a.reshape(units, a.shape[0] // units, *a.shape[1:])

    def one_unit(x: jax.Array, inputs: tuple) -> tuple[jax.Array, tuple]:
        layer_state, k, v = inputs
        unit_cache = UnitCache(k, v, prefill)
        with layout_with(attention=unit_cache.attend, latent_cache=unit_cache.attend_latent):
            x, _ = nnx.merge(graphdef, layer_state)(x, positions)
        return x, unit_cache.updated()

    x, (k, v) = jax.lax.scan(one_unit, x, (stacked, per_unit(k), per_unit(v)))
    return x, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])


def last_logits(model: Transformer, x: jax.Array, index: jax.Array, dtype: Any) -> jax.Array:
    """float32 logits [B, V] of the residual stream ``x`` [B, S, E] at ``index`` [B]."""
    picked = jnp.take_along_axis(x, index[:, None, None], axis=1)  # [B, 1, E]
    return model.logits(picked, dtype=dtype)[:, 0]


def generation_config(cfg: Config) -> Config:
    """``cfg`` as generation runs it: sequence parallelism off, MoE dispatch dropless."""
    moe = dataclasses.replace(cfg.model.moe, dispatch="dropless")
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, moe=moe),
        parallel=dataclasses.replace(cfg.parallel, sequence_parallel=False))


def check_weights(cfg: ModelConfig, params: dict, buffers: dict, vocab_rows: int | None = None
                  ) -> None:
    """A one-line :class:`ConfigError` naming the first array whose shape is not the one
    ``cfg``'s model (its vocabulary padded to ``vocab_rows``) has (a checkpoint of another
    model, or a wrong ``model.*`` override)."""
    _, want_params, want_buffers = nnx.split(abstract_model(cfg, vocab_rows=vocab_rows),
                                             nnx.Param, ...)
    want = {"params": nnx.to_pure_dict(want_params), "buffers": nnx.to_pure_dict(want_buffers)}
    got = {"params": params, "buffers": buffers}
    shapes = [{param_name(k): tuple(np.shape(a))
               for k, a in jax.tree_util.tree_leaves_with_path(tree)} for tree in (got, want)]
    for name in sorted(set(shapes[0]) | set(shapes[1])):
        have, need = shapes[0].get(name), shapes[1].get(name)
        if have != need:
            raise ConfigError(f"generate: weight {name} is {have or 'missing'} but the model "
                              f"(model.*) needs {need or 'none'}")


class Step(NamedTuple):
    """One step of :meth:`Generator.stream`: the token each prompt got (int32 [prompts]) and
    which prompts were still running when it was chosen (a stopped row's token is filler)."""

    tokens: np.ndarray
    active: np.ndarray


class Generator:
    """Generation for one model on one mesh: the parameters laid out, prefill and the decode
    step jitted (module docstring). ``mesh`` None runs on the default device, unsharded."""

    def __init__(self, cfg: Config, params: dict, buffers: dict | None = None,
                 mesh: jax.sharding.Mesh | None = None):
        self.cfg = generation_config(cfg)
        self.mesh = mesh
        self.dtype = DTYPES[cfg.train.dtype]
        # The vocabulary padded for this mesh, whatever padding the weights were saved with.
        self.vocab_rows = self.cfg.vocab_rows()
        self.graphdef = nnx.split(abstract_model(self.cfg.model, vocab_rows=self.vocab_rows),
                                  nnx.Param, ...)[0]
        buffers = complete_buffers(self.cfg.model, buffers or {})  # an import's window flags
        # A LoRA run's weights: the adapters merged (jaxpar/model/lora.py), the same function.
        params = merged_weights(params, cfg.train.lora)
        if np.shape(params["embedding"])[0] >= self.cfg.model.vocab_size:  # else: another model
            params = fit_vocab(params, self.vocab_rows)
        check_weights(self.cfg.model, params, buffers, self.vocab_rows)
        self.mesh_shape = dict(mesh.shape) if mesh is not None else None
        if mesh is not None:
            unsupported = [f"{a}={n}" for a, n in mesh.shape.items()
                           if n > 1 and a not in SUPPORTED_AXES]
            if unsupported:
                raise ConfigError(f"generate: mesh {' '.join(unsupported)} is not supported; "
                                  f"generation splits over {', '.join(SUPPORTED_AXES)} only")
            params, buffers = self._place(params, buffers or {})
        else:  # onto the default device once, not with every call (host arrays would be)
            params, buffers = jax.device_put((params, buffers or {}))
        self.params, self.buffers = params, buffers
        # Outputs laid out as the next step takes them, so the step never sees a new layout
        # (which would compile it again). The cache is donated: updated in place, not copied.
        out = None if mesh is None else (self._rows_sharding(1), self._cache_sharding())
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("max_len", "sampling"),
                                out_shardings=out)
        self._decode = jax.jit(self._decode_fn, static_argnames=("sampling",),
                               donate_argnums=(2,), out_shardings=out)
        self._score = jax.jit(self._score_fn, out_shardings=(
            None if mesh is None else (self._rows_sharding(2), self._rows_sharding(2))))

    # ----------------------------------------------------------------------------------------
    # Layout

    def _place(self, params: dict, buffers: dict) -> tuple[dict, dict]:
        """The parameters (and MoE buffers) put on the mesh as the rules table lays them out."""
        model = abstract_model(self.cfg.model, vocab_rows=self.vocab_rows)
        rules = logical_rules(self.cfg)
        specs, buffer_specs = model_specs(model, params, buffers, rules, self.mesh_shape)
        return (jax.device_put(params, named_shardings(self.mesh, specs)),
                jax.device_put(buffers, named_shardings(self.mesh, buffer_specs)))

    def batch_multiple(self) -> int:
        """The batch is padded to a multiple of this: the devices splitting it."""
        if self.mesh_shape is None:
            return 1
        return math.prod(self.mesh_shape[a] for a in logical_rules(self.cfg)["batch"]
                         if a in BATCH_AXES)

    def _hooks(self):
        if self.mesh is None:
            return nullcontext()
        platform = self.mesh.devices.flat[0].platform
        return model_hooks(self.cfg, self.mesh_shape, platform)

    def _mesh_scope(self):
        return nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _rows_sharding(self, ndim: int) -> NamedSharding | None:
        if self.mesh is None:
            return None
        spec = resolve_spec("prompt batch", ("batch",) + (None,) * (ndim - 1), None,
                            logical_rules(self.cfg), self.mesh_shape)
        return NamedSharding(self.mesh, spec)

    def _cache_sharding(self) -> KVCache:
        spec = resolve_spec("kv cache", cache_axes(self.cfg.model), None, logical_rules(self.cfg),
                            self.mesh_shape)
        return KVCache(NamedSharding(self.mesh, spec), NamedSharding(self.mesh, spec))

    # ----------------------------------------------------------------------------------------
    # The jitted pieces

    def _prefill_attention(self, s: int) -> Attention:
        """The model's attention for a prompt of S tokens (``model.attention``, as training
        resolves it): blockwise when S spans several blocks (S is then a multiple of the
        block: :meth:`prompt_width`)."""
        m = self.cfg.model
        block = m.attention_block if s % m.attention_block == 0 else s
        platform = (self.mesh.devices.flat[0].platform if self.mesh is not None
                    else jax.default_backend())
        return attention_fn(resolve(m.attention, platform, s, block, self.dtype, model=m), block,
                            m)

    def prompt_width(self, longest: int) -> int:
        """The padded prompt length S: a multiple of :data:`LENGTH_BUCKET`, or of
        ``model.attention_block`` past one block (so that the blockwise kernel tiles it)."""
        block = self.cfg.model.attention_block
        return _bucket(longest, LENGTH_BUCKET if longest <= block else block)

    def _model(self, params: dict, buffers: dict) -> Transformer:
        return nnx.merge(self.graphdef, params, buffers)

    def _prefill_fn(self, params: dict, buffers: dict, tokens: jax.Array, lengths: jax.Array,
                    key: jax.Array, max_len: int, sampling: Sampling
                    ) -> tuple[jax.Array, KVCache]:
        """Prompts [B, S] (right-padded; ``lengths`` [B]) -> (first new tokens [B], cache)."""
        m = self.cfg.model
        with self._hooks():
            model = self._model(params, buffers)
            b, s = tokens.shape
            cache = model_cache(m, b, max_len, self.dtype)
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            x, cache = forward_cached(model, tokens, positions, cache, self.dtype,
                                      self._prefill_attention(s))
            logits = last_logits(model, x, lengths - 1, self.dtype)
            return sample(logits, key, jnp.int32(0), sampling), cache

    def _decode_fn(self, params: dict, buffers: dict, cache: KVCache, tokens: jax.Array,
                   positions: jax.Array, step: jax.Array, key: jax.Array, sampling: Sampling
                   ) -> tuple[jax.Array, KVCache]:
        """One token per row: ``tokens`` [B] at ``positions`` [B] -> (next tokens [B], cache)."""
        with self._hooks():
            model = self._model(params, buffers)
            x, cache = forward_cached(model, tokens[:, None], positions[:, None], cache,
                                      self.dtype)
            logits = last_logits(model, x, jnp.zeros_like(positions), self.dtype)
            return sample(logits, key, step, sampling), cache

    def _score_fn(self, params: dict, buffers: dict, tokens: jax.Array, targets: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        """Inputs and targets [B, S] -> (float32 log-probability of each target, whether it is
        the argmax), both [B, S]: one forward pass of the training model, no cache."""
        with self._hooks():
            model = self._model(params, buffers)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
            x, _ = model.run_layers(model.embed(tokens, dtype=self.dtype), positions)
            logits = model.logits(x, dtype=self.dtype)
            picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            logprobs = picked - jax.nn.logsumexp(logits, axis=-1)
            return logprobs, jnp.argmax(logits, axis=-1) == targets

    def score(self, sequences: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each sequence of n >= 2 tokens, two arrays of n - 1: the log-probability (float32)
        the model gives each of its tokens 1..n-1 after those before it, and whether that token
        is the model's greedy (argmax) choice there. The sequences are scored as one batch,
        right-padded as :meth:`pack` pads prompts (causal: the padding changes nothing before
        it); a batch compiles once per padded shape."""
        if any(len(s) < 2 for s in sequences):
            raise ConfigError("score: every sequence needs at least two tokens")
        if any(not 0 <= s[-1] < self.cfg.model.vocab_size for s in sequences):
            raise ConfigError(f"score: token ids must be in [0, {self.cfg.model.vocab_size})")
        tokens, lengths = self.pack([s[:-1] for s in sequences])
        targets = np.zeros_like(tokens)
        for i, seq in enumerate(sequences):
            targets[i, :len(seq) - 1] = seq[1:]
        with self._mesh_scope():
            logprobs, greedy = jax.device_get(self._score(
                self.params, self.buffers, self._put(tokens), self._put(targets)))
        return [(logprobs[i, :n], greedy[i, :n]) for i, n in enumerate(lengths[:len(sequences)])]

    # ----------------------------------------------------------------------------------------
    # The loop

    def stream(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
               sampling: Sampling = Sampling(), seed: int = 0, eos_id: EosIds = None
               ) -> Iterator[Step]:
        """Yield one :class:`Step` per generated position, until every prompt has produced an
        ``eos_id`` (one id or several; it is yielded, then the row stops) or ``max_tokens``
        tokens."""
        stops = eos_array(eos_id)
        if max_tokens < 1:
            raise ConfigError(f"--max-tokens {max_tokens}: must be >= 1")
        tokens, lengths = self.pack(prompts)
        n, key = len(prompts), jax.random.key(seed)
        # The mesh is entered per call, not around the loop: a caller's own jax work between
        # two steps runs outside it.
        with self._mesh_scope():
            token, cache = self._prefill(
                self.params, self.buffers, self._put(tokens), self._put(lengths), key,
                max_len=_bucket(tokens.shape[1] + max_tokens), sampling=sampling)
        active, positions = np.ones(n, bool), lengths
        for step in range(1, max_tokens + 1):
            host = np.asarray(token)[:n]
            yield Step(host, active.copy())
            active &= ~np.isin(host, stops)
            if step == max_tokens or not active.any():
                return
            with self._mesh_scope():
                token, cache = self._decode(self.params, self.buffers, cache, token,
                                            self._put(positions), jnp.int32(step), key,
                                            sampling=sampling)
            positions = positions + 1

    def pack(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Prompts -> (tokens int32 [B, S] right-padded with 0, lengths int32 [B]); B is the
        prompt count padded with copies of the first prompt to :meth:`batch_multiple`."""
        vocab = self.cfg.model.vocab_size
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("generate: every prompt needs at least one token")
        if any(min(p) < 0 or max(p) >= vocab for p in prompts):
            raise ConfigError(f"generate: prompt token ids must be in [0, {vocab})")
        multiple = self.batch_multiple()
        rows = list(prompts) + [prompts[0]] * (-len(prompts) % multiple)
        lengths = np.array([len(p) for p in rows], np.int32)
        tokens = np.zeros((len(rows), self.prompt_width(int(lengths.max()))), np.int32)
        for i, prompt in enumerate(rows):
            tokens[i, :len(prompt)] = prompt
        return tokens, lengths

    def _put(self, array: np.ndarray) -> jax.Array:
        sharding = self._rows_sharding(array.ndim)
        return jnp.asarray(array) if sharding is None else jax.device_put(array, sharding)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 sampling: Sampling = Sampling(), seed: int = 0, eos_id: EosIds = None,
                 on_step: Callable[[Step], None] | None = None) -> list[list[int]]:
        """The new tokens of each prompt, up to and without its first ``eos_id``."""
        stops = eos_array(eos_id)
        out: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, max_tokens=max_tokens, sampling=sampling, seed=seed,
                                eos_id=eos_id):
            if on_step is not None:
                on_step(step)
            for i in np.flatnonzero(step.active):
                if step.tokens[i] not in stops:
                    out[i].append(int(step.tokens[i]))
        return out


def eos_array(eos_id: EosIds) -> np.ndarray:
    """The ids that end a row (``eos_id``: None, one id or several) as an int array."""
    return np.asarray([] if eos_id is None else eos_id, np.int64).reshape(-1)


def _bucket(n: int, multiple: int = LENGTH_BUCKET) -> int:
    return -(-n // multiple) * multiple


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0, eos_id: EosIds = None,
             cfg: Config | None = None, mesh: jax.sharding.Mesh | None = None
             ) -> list[list[int]]:
    """Generate from a model (``create_model`` or a trained one): the new tokens of each prompt
    (lists of token ids), up to and without the first ``eos_id`` (one id or several). ``cfg``
    (default: the model's config in an otherwise default :class:`Config`) gives the compute
    dtype and the rules table; ``mesh`` splits the prompts and heads (module docstring). For
    many calls, build a :class:`Generator` once: it keeps the compiled prefill and decode
    step."""
    cfg = cfg if cfg is not None else Config(model=model.cfg)
    _, params, buffers = nnx.split(model, nnx.Param, ...)
    generator = Generator(cfg, nnx.to_pure_dict(params), nnx.to_pure_dict(buffers), mesh)
    return generator.generate(prompts, max_tokens=max_tokens, sampling=sampling, seed=seed,
                              eos_id=eos_id)
