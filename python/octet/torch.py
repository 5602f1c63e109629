"""octet.torch.Linear: a torch.nn.Module whose forward and backward run octet's FP8 Linear;
LayerNormLinear and LayerNormMLP are the same machinery over octet's normed Linear and its MLP.

- Parameters are ordinary torch.nn.Parameters that share memory with octet's FP32 master weights
  (DLPack, no copy): any torch optimizer, state_dict and torch.save work. An in-place update (the
  optimizer's step, load_state_dict) is seen through the tensors' version counters, and the next
  forward casts the weights again.
- Gradients: octet writes them into its own gradient memory, which becomes the parameters' .grad
  (set_to_none=True and False both work; a replaced .grad is added to).
- The FP8 state (scales, amax histories) is in the module's buffers: fp8_<name>, refreshed from
  octet when state_dict() is taken and written back on load_state_dict().
- Calls run on PyTorch's current stream (octet orders its own stream after it and back).
- torch.utils.checkpoint (use_reentrant=False): the recomputed forward rebuilds the output with
  the scales of the original forward and updates no FP8 state, so gradients are bitwise those
  without checkpointing. octet keeps its FP8 copy of the input (one byte per element) across
  the checkpoint.
"""
from __future__ import annotations

import weakref

import torch

import octet

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP"]

_COMPUTE = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# Capsules both ways and the raw current stream (octet._lib.torch_exports): octet orders every
# call on the stream it is given, so the stream handshake of Tensor.__dlpack__ and of from_dlpack
# on a tensor object is not needed.
_to_dlpack, _raw_stream = octet._lib.torch_exports()
_from_dlpack = torch.utils.dlpack.from_dlpack


def _stream(device: torch.device) -> int:
    """PyTorch's current stream on `device` (not on the current device); 0 for the CPU."""
    return _raw_stream(device.index) if device.type == "cuda" else 0


def _to_torch(exported) -> torch.Tensor:
    return _from_dlpack(exported.__dlpack__())


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, scope, grad_enabled):
        module._sync_weights()
        device = module._device
        if x.device != device:
            raise octet.OctetValueError(
                f"{module._kind()} on {device} got input on {x.device} (octet never moves tensors)")
        recompute = torch._C._current_graph_task_id() != -1  # a forward inside backward
        original = None
        if recompute:
            original = module._pending_record()
            if original is None:
                raise octet.OctetError(
                    f"{module._kind()}: a forward inside backward (activation checkpointing) with "
                    "no pending forward of this module to recompute; use "
                    "torch.utils.checkpoint(..., use_reentrant=False)")
            mode = "recompute"
        else:
            # Grad mode is off inside Function.forward: the module passes it in. A norm's gamma
            # and beta are no inputs of the Function; their gradients go to .grad as the
            # weight's do.
            wants_grad = any(ctx.needs_input_grad[:3]) or any(
                p.requires_grad for p in module._params())
            mode = "training" if grad_enabled and wants_grad else "inference"
        y, record = module._core.forward(_to_dlpack(x), mode, original, _stream(device), _to_torch)
        ctx.record, ctx.module, ctx.finalize = record, module, None
        if mode == "training":
            module._prune_records()  # else one dead weakref per forward piles up for good
            module._records.append(weakref.ref(record))
            if scope is not None and scope.first_module is None:
                scope.first_module = module  # its backward comes last: it ends the pass
                ctx.finalize = scope.registry
        return y

    @staticmethod
    def backward(ctx, dy):
        module, record = ctx.module, ctx.record
        device = module._device
        stream = _stream(device)
        grads = module._prepare_grads(stream)
        # autograd's gradient may be any layout; octet takes contiguous tensors only.
        dx = module._core.backward(_to_dlpack(dy.contiguous()), record, stream, _to_torch)
        module._finish_grads(grads)
        if ctx.finalize is not None:
            ctx.finalize.finalize_backward()
        return dx, None, None, None, None, None


class Linear(torch.nn.Module):
    """y = x W^T + b with octet: FP8 GEMMs inside `with octet.fp8_autocast(recipe):`, the
    compute dtype (float32 or bfloat16) outside. Master weights are float32."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, seed=None):
        super().__init__()
        self._build(in_features, out_features, bias, device, dtype, seed, norm=None, eps=0.0)

    def _build(self, in_features, out_features, bias, device, dtype, seed, norm, eps):
        self.in_features, self.out_features = int(in_features), int(out_features)
        device, compute, seed = self._placement(device, dtype, seed)
        self._core = octet.Linear(in_features, out_features, bias, str(device), compute, seed,
                                  norm=norm, eps=eps)
        # The norm's gamma and beta under Transformer Engine's names (LayerNormLinear).
        self._bind({"": self._core}, [("weight", "", "weight"), ("bias", "", "bias"),
                                      ("layer_norm_weight", "", "norm_weight"),
                                      ("layer_norm_bias", "", "norm_bias")])

    def _kind(self):
        return f"octet.torch.{type(self).__name__}"

    def _placement(self, device, dtype, seed):
        """Sets the module's device; returns it, octet's compute dtype name and the seed."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.init()  # before the first raw stream lookup
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise octet.OctetValueError(f"{self._kind()}: expected a cpu or cuda device, got {device}")
        self._device = device
        compute = dtype if dtype is not None else torch.float32
        if compute not in _COMPUTE:
            raise octet.OctetValueError(f"{self._kind()}: dtype must be float32 or bfloat16, got {compute}")
        if seed is None:  # follows torch.manual_seed
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        return device, _COMPUTE[compute], seed

    def _bind(self, layers, sources):
        """The parameters over octet's memory. layers: {prefix: octet.Linear} (the prefix names
        the layer's FP8 buffers); sources: (parameter, layer prefix, octet view) in parameter
        order. A bias the layer lacks is None; a norm's parameters without a norm are absent."""
        self._layers = layers
        kept = []
        for name, prefix, which in sources:
            layer = layers[prefix]
            present = {"bias": layer.has_bias, "norm_weight": layer.norm is not None,
                       "norm_bias": layer.norm == "layernorm"}.get(which, True)
            if present:
                setattr(self, name, torch.nn.Parameter(self._view(prefix, which)))
                kept.append((name, prefix, which))
            elif which == "bias":
                setattr(self, name, None)
        # The parameters' names, fixed now: the module's memory is octet's.
        self._param_keys = tuple(name for name, _, _ in kept)
        self._versions = self._param_versions()
        self._ptrs = tuple(p.data_ptr() for p in self._params())
        # octet's gradient memory never moves: one view each, made once, in _params()'s order.
        self._grad_views = [self._view(prefix, "grad_" + which) for _, prefix, which in kept]
        self._grad_ptrs = tuple(v.data_ptr() for v in self._grad_views)
        self._records = []
        self._recipe = None  # the recipe of the FP8 state (set by the first FP8 forward or a load)

    # --- octet views -----------------------------------------------------------------------------

    def _view(self, prefix, which):
        return self._layers[prefix].view(which, _stream(self._device), _to_torch)

    def _params(self):
        """The parameters in _param_keys' order, read from _parameters (no
        Module.__getattr__); None for one set to None since."""
        params = self._parameters
        return tuple([params.get(name) for name in self._param_keys])

    def _param_versions(self, params=None):
        return tuple([p._version for p in params or self._params()])

    # Attributes that change at every call are set only when their value changes, or mutated in
    # place: torch.nn.Module.__setattr__ costs microseconds a call.

    def _sync_weights(self):
        params = self._params()
        try:
            ptrs = tuple([p.data_ptr() for p in params])
        except AttributeError:  # a parameter set to None
            ptrs = None
        if ptrs != self._ptrs:
            raise octet.OctetError(
                f"{self._kind()}: a parameter was replaced (param.data = ... or .to()); "
                "octet's parameters must keep their memory: copy into them instead")
        versions = self._param_versions(params)
        if versions != self._versions:
            self._core.weights_updated()
            self._versions = versions
        scope = octet.active_scope()
        if scope is not None and scope.recipe is not self._recipe:
            self._recipe = scope.recipe

    def _prune_records(self):
        """Keeps the records of forwards whose backward has not run yet."""
        self._records[:] = [r for r in self._records if (rec := r()) is not None and not rec.done]

    def _pending_record(self):
        self._prune_records()
        return self._records[-1]() if self._records else None

    def _prepare_grads(self, stream):
        """Makes the parameters' .grad octet's gradient memory, so octet adds into it."""
        params = self._params()
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            self._core.zero_grad(True, stream)
            for p, v in zip(params, self._grad_views):
                p.grad = v
            return None
        if all(g is not None for g in grads) and \
                tuple([g.data_ptr() for g in grads]) == self._grad_ptrs:
            return None  # octet accumulates in place
        self._core.zero_grad(True, stream)
        return list(zip(params, self._grad_views))

    @staticmethod
    def _finish_grads(pending):
        for p, v in pending or ():
            if p.grad is None:
                p.grad = v.clone()
            else:
                p.grad.add_(v)

    # --- the FP8 state in buffers -------------------------------------------------------------

    def fp8_state(self, recipe=None):
        """{name: tensor} copies of the FP8 state for `recipe` (default: the last one used)."""
        recipe = recipe or self._recipe
        if recipe is None:
            return {}
        stream = _stream(self._device)
        return {prefix + name.replace(".", "_"): value
                for prefix, layer in self._layers.items()
                for name, value in layer.fp8_state(recipe, stream, _to_torch).items()}

    def _refresh_buffers(self):
        for name, value in self.fp8_state().items():
            self.register_buffer("fp8_" + name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._refresh_buffers()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def get_extra_state(self):
        return {"fp8_recipe": self._recipe.fields if self._recipe else None}

    def set_extra_state(self, state):
        fields = (state or {}).get("fp8_recipe")
        if fields:
            kind = fields["kind"]
            if kind == "delayed":
                self._recipe = octet.Recipe.delayed(fields["margin"], fields["amax_history_len"],
                                                    fields["amax_compute_algo"], fields["fp8_format"])
            elif kind == "current":
                self._recipe = octet.Recipe.current(fields["power_of_2_scales"], fields["fp8_format"])
            else:
                self._recipe = getattr(octet.Recipe, kind)()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None:
            self.set_extra_state(extra)
        if self._recipe is not None:
            self._refresh_buffers()  # buffers of the right shapes to load into
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self._recipe is not None:
            stream = _stream(self._device)
            for prefix, layer in self._layers.items():
                names = layer.fp8_state(self._recipe, stream, _to_torch)
                state = {name: getattr(self, "fp8_" + prefix + name.replace(".", "_")).contiguous()
                         for name in names}
                layer.load_fp8_state(self._recipe, state, stream)
        self._versions = self._param_versions()
        self._core.weights_updated()

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half() would move the parameters away from octet's memory.
        probe = fn(torch.empty(0, device=self._device))
        if probe.device != self._device or probe.dtype != torch.float32:
            raise octet.OctetError(
                f"{self._kind()} lives on the device it was created on, in float32 masters: "
                "create it with device=... instead of moving it")
        return self

    # --- forward -------------------------------------------------------------------------------

    def forward(self, x):
        return _LinearFunction.apply(x, self.weight, self.bias, self, octet.active_scope(),
                                     torch.is_grad_enabled())

    def extra_repr(self):
        norm = f", normalization={self._core.norm}" if self._core.norm else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}{norm}, device={self._device}"


_NORMALIZATIONS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}


def _norm_name(normalization, module):
    """octet's name of a Transformer Engine normalization ('LayerNorm' or 'RMSNorm')."""
    norm = _NORMALIZATIONS.get(normalization)
    if norm is None:
        raise octet.OctetValueError(
            f"{module._kind()}: normalization must be 'LayerNorm' or 'RMSNorm', "
            f"got {normalization!r}")
    return norm


class LayerNormLinear(Linear):
    """Transformer Engine's LayerNormLinear: y = Linear(norm(x)), the norm over in_features
    ('LayerNorm' or 'RMSNorm', epsilon `eps`) with FP32 parameters layer_norm_weight (ones) and,
    for LayerNorm, layer_norm_bias (zeros). Under fp8_autocast with delayed scaling the norm writes
    the GEMM's FP8 input in its own pass over x (no high-precision norm output is made); everything
    else (parameters, FP8 state, checkpointing) is as octet.torch.Linear."""

    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 device=None, dtype=None, seed=None):
        torch.nn.Module.__init__(self)
        norm = _norm_name(normalization, self)
        self._build(in_features, out_features, bias, device, dtype, seed, norm=norm, eps=eps)


class LayerNormMLP(Linear):
    """Transformer Engine's LayerNormMLP: y = fc2(act(fc1(norm(x)))) for x [..., hidden_size],
    fc1 hidden_size -> ffn_hidden_size (twice that for 'swiglu': [gate | up]), fc2 back to
    hidden_size; activation 'gelu' (tanh), 'swiglu' or 'srelu'; the norm 'LayerNorm' or 'RMSNorm'
    with epsilon `eps`. Parameters under TE's names: layer_norm_weight, layer_norm_bias (LayerNorm),
    fc1_weight, fc1_bias, fc2_weight, fc2_bias (FP32). Under fp8_autocast with delayed scaling
    the norm writes fc1's FP8 input, the activation fc2's and the activation's backward fc1's FP8
    gradient, each in its own pass. Everything else (FP8 state in buffers fp8_fc1_* and fp8_fc2_*,
    state_dict, checkpointing) is as octet.torch.Linear."""

    _ACTIVATIONS = ("gelu", "swiglu", "srelu")

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True,
                 normalization="LayerNorm", activation="gelu", device=None, dtype=None, seed=None):
        torch.nn.Module.__init__(self)
        norm = _norm_name(normalization, self)
        if activation not in self._ACTIVATIONS:
            raise octet.OctetValueError(
                f"octet.torch.LayerNormMLP: activation must be one of {self._ACTIVATIONS}, "
                f"got {activation!r}")
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.in_features = self.out_features = self.hidden_size
        self.activation, self.normalization = activation, normalization
        device, compute, seed = self._placement(device, dtype, seed)
        self._core = octet.MLP(hidden_size, ffn_hidden_size, bias, activation, norm, eps,
                               str(device), compute, seed)
        fc1, fc2 = self._core.fc1, self._core.fc2
        self._bind({"fc1_": fc1, "fc2_": fc2},
                   [("layer_norm_weight", "fc1_", "norm_weight"),
                    ("layer_norm_bias", "fc1_", "norm_bias"),
                    ("fc1_weight", "fc1_", "weight"), ("fc1_bias", "fc1_", "bias"),
                    ("fc2_weight", "fc2_", "weight"), ("fc2_bias", "fc2_", "bias")])

    def forward(self, x):
        # The Function's two parameter inputs put it in autograd's graph whatever x is.
        return _LinearFunction.apply(x, self.fc1_weight, self.fc2_weight, self,
                                     octet.active_scope(), torch.is_grad_enabled())

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, " \
               f"activation={self.activation}, normalization={self.normalization}, " \
               f"bias={self.fc1_bias is not None}, device={self._device}"
