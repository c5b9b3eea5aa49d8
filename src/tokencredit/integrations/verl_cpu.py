"""verl on a CPU: a dry run of a verl config, the plugin included, before paying for GPUs.

Loaded by verl itself, through its ``VERL_USE_EXTERNAL_MODULES`` hook, in every process (driver,
TaskRunner, every Ray worker), and selected with ``VERL_PLATFORM=cpu``::

    VERL_USE_EXTERNAL_MODULES=tokencredit.integrations.verl_cpu VERL_PLATFORM=cpu \\
    python3 -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.name=tc_hf ...

What it adds, all through verl's own registries (no file of verl is edited):

* a ``cpu`` platform in ``verl.plugin.platform.PlatformRegistry``: the torch device ``cpu``,
  gloo collectives, Ray's ``GPU`` resource for scheduling (run Ray with
  ``+ray_kwargs.ray_init.num_gpus=N``: logical GPUs, each one worker process on the CPU);
* verl's FSDP engines (and tokencredit's actor engine) registered for the device ``cpu`` in
  ``EngineRegistry`` (verl registers them for ``cuda`` and ``npu``);
* a rollout ``tc_hf`` in verl's ``RolloutReplicaRegistry`` and rollout registry: one Ray actor per
  replica that generates with transformers ``generate`` (token in, token out, with log-probs,
  concurrent requests batched), fed the actor's weights by verl's own weight-update path after
  every step (vLLM and SGLang have no CPU build that fits verl 0.9's transformers pin);
* three CUDA assumptions patched: the process-group backend string ``cpu:gloo,<device>:<backend>``
  (a duplicate on a CPU, which torch rejects), the critic loader's hard-coded
  ``attn_implementation="flash_attention_2"`` (no CPU build; the model's own configured
  implementation is used instead) and the pinned host memory of the reference policy's FSDP2
  ``CPUOffloadPolicy`` (pinning needs an accelerator).

What a CPU dry run proves and what not: docs/integrations.md ("Dry-run a verl config on CPU").
"""

from __future__ import annotations

import logging
import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

log = logging.getLogger(__name__)

__all__ = ["PLATFORM", "ROLLOUT", "PlatformCPU", "HFReplica", "HFRolloutAdapter", "install"]

#: ``VERL_PLATFORM`` value that selects this platform
PLATFORM = "cpu"
#: ``actor_rollout_ref.rollout.name`` of the transformers rollout
ROLLOUT = "tc_hf"


# -- the device module: torch.cpu, plus the CUDA-module calls verl makes, as no-ops ----------------


def _zero(*args, **kwargs) -> int:
    return 0


def _none(*args, **kwargs) -> None:
    return None


class _CPUDeviceModule(types.ModuleType):
    """What ``verl.utils.device.get_torch_device()`` returns: ``torch.cpu`` with the memory and
    stream calls of ``torch.cuda`` that verl makes (cache, IPC, memory statistics) as no-ops."""

    def __init__(self):
        super().__init__("tokencredit_verl_cpu_device")
        self.empty_cache = _none
        self.ipc_collect = _none
        self.set_per_process_memory_fraction = _none
        self.memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_allocated = _zero
        self.max_memory_reserved = _zero
        self.reset_peak_memory_stats = _none
        self.get_device_name = lambda *a, **k: "cpu"
        self.set_device = _none
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: None  # torch.manual_seed seeds the CPU generator already
        self.manual_seed_all = lambda seed: None

    def mem_get_info(self, *args, **kwargs):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """The CPU as a verl platform: torch device ``cpu``, gloo, Ray ``GPU`` resources as slots."""

    _module = _CPUDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM

    def current_device(self):
        # a device string, not an index: verl builds torch.device(...) / .to(...) from it
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        return None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _active() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


# -- the two CUDA assumptions -----------------------------------------------------------------------


def _dedup_backend(backend):
    """``cpu:gloo,cpu:gloo`` (verl's ``cpu:gloo,<device>:<backend>`` on a CPU) -> ``cpu:gloo``."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    parts = []
    for p in backend.split(","):
        if p not in parts:
            parts.append(p)
    return ",".join(parts)


def _patch_process_group() -> None:
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_tc_cpu", False):
        return
    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        return original(_dedup_backend(backend), *args, **kwargs)

    init_process_group._tc_cpu = True
    dist.init_process_group = init_process_group


def _patch_critic_loader() -> None:
    """verl's ``load_valuehead_model`` asks for flash_attention_2; load the value head with the
    attention implementation the model config names (sdpa unless set)."""
    import verl.utils.model as vum

    if getattr(vum.load_valuehead_model, "_tc_cpu", False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None) or "sdpa"
        if attn.startswith("flash"):
            attn = "sdpa"
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=attn, trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._tc_cpu = True
    vum.load_valuehead_model = load_valuehead_model


def _patch_offload_pinning() -> None:
    """verl's forward-only engines (the reference policy) shard with FSDP2's
    ``CPUOffloadPolicy(pin_memory=True)``; pinned host memory needs an accelerator, and on a CPU the
    parameters are in host memory already: the same policy without pinning."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    original = impl.CPUOffloadPolicy
    if original is None or getattr(original, "_tc_cpu", False):
        return

    def CPUOffloadPolicy(*args, **kwargs):  # noqa: N802 (stands in for the class)
        kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    CPUOffloadPolicy._tc_cpu = True
    impl.CPUOffloadPolicy = CPUOffloadPolicy


def _register_engines_for_cpu() -> None:
    """verl's FSDP engines (every model type and backend registered for ``cuda``) for ``cpu`` too."""
    from verl.workers.engine.base import EngineRegistry

    import verl.workers.engine  # noqa: F401 (registers verl's engines)

    for model_type, backends in EngineRegistry._engines.items():
        for backend, devices in backends.items():
            cls = devices.get("cuda") or devices.get(("cuda", "nvidia"))
            if cls is not None and "cpu" not in devices and backend in ("fsdp", "fsdp2"):
                devices["cpu"] = cls


# -- the transformers rollout --------------------------------------------------------------------


def rollout_dtype(dtype) -> str:
    """The torch dtype name a ``tc_hf`` server generates in, from verl's ``rollout.dtype``, read by
    verl's own ``PrecisionType.to_dtype`` (its spellings: ``bfloat16``/``bf16``, ``float32``/``fp32``/
    ``32``, ``float16``/``fp16``/``16``). verl's default is bfloat16 (the precision vLLM samples in on
    a GPU); unset (a replica config without the key) keeps float32. A bf16 rollout against the
    fp32 actor is the training-inference mismatch that verl's ``algorithm.rollout_correction`` corrects."""
    if dtype is None:
        return "float32"
    from verl.utils.torch_dtypes import PrecisionType

    try:
        return str(PrecisionType.to_dtype(dtype)).removeprefix("torch.")
    except RuntimeError:
        raise ValueError(f"actor_rollout_ref.rollout.dtype: expected one of bfloat16, bf16, float32, fp32, float16, "
                         f"fp16 for the tc_hf rollout, got {dtype!r}") from None


def _server_name(replica_rank: int, role: str = "rollout", suffix: str = "") -> str:
    return f"tc_hf_{role}_server_{replica_rank}{suffix}"


def _replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """A ``tc_hf`` rollout replica: one named Ray actor (:class:`.hf_server.HFRolloutServer`) on
        the CPU, for the policy's rollout, a distillation teacher or a reward model."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            import ray

            from .hf_server import HFRolloutServer

            role = "teacher" if self.is_teacher_model else "reward" if self.is_reward_model else "rollout"
            name = _server_name(self.replica_rank, role, self.name_suffix)
            mc = self.model_config
            get = (lambda k, d=None: mc.get(k, d)) if hasattr(mc, "get") else (lambda k, d=None: getattr(mc, k, d))
            path = get("local_path")
            if path is None:
                from verl.utils.fs import copy_to_local

                path = copy_to_local(get("path"))
            server = ray.remote(num_cpus=0)(HFRolloutServer).options(
                name=name, max_concurrency=self.max_concurrency, get_if_exists=True,
            ).remote(path, response_length=self.config.response_length, prompt_length=self.config.prompt_length,
                     dtype=rollout_dtype(getattr(self.config, "dtype", None)),
                     trust_remote_code=bool(get("trust_remote_code", False)))
            await server.weights_version.remote()  # built, its model loaded, before the first request
            self.servers = [server]
            self._server_handle = server
            self._server_address = name

    return HFReplica


def _adapter_class():
    from verl.workers.rollout.base import BaseRollout

    class HFRolloutAdapter(BaseRollout):
        """The actor worker's side of the ``tc_hf`` rollout: sends verl's weight updates to the
        replica's server (rank 0 of each replica's workers; the server holds a full copy)."""

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)
            self.replica_rank = rank // world
            self.is_leader = rank % world == 0
            self.sleep_level = 1

        async def resume(self, tags):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            import ray
            from torch.distributed.tensor import DTensor

            if wire_format != "named_tensors":
                raise ValueError(f"tc_hf rollout: wire_format: expected 'named_tensors', got {wire_format!r}")
            if kwargs.get("peft_config") is not None:
                raise ValueError("actor_rollout_ref.model.lora.merge: the tc_hf rollout takes merged weights; "
                                 "expected True with a LoRA actor, got False")
            state = {}
            for name, t in weights:  # every rank iterates (FSDP gathers are collective)
                t = t.full_tensor() if isinstance(t, DTensor) else t
                if self.is_leader:
                    state[name] = t.detach().to("cpu", copy=True)
            if self.is_leader:
                server = ray.get_actor(_server_name(self.replica_rank))
                await server.load_weights.remote(state, global_steps=kwargs.get("global_steps"))

    return HFRolloutAdapter


HFReplica = None
HFRolloutAdapter = None


def _register_rollout() -> None:
    global HFReplica, HFRolloutAdapter
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    HFReplica = _replica_class()
    HFRolloutAdapter = _adapter_class()
    RolloutReplicaRegistry.register(ROLLOUT, lambda: HFReplica)
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = f"{__name__}.HFRolloutAdapter"


def _math_attention_where_flash_is_broken() -> None:
    """torch 2.13's bf16 flash attention fails on an AMX CPU whose ATen kernels are held below
    AVX-512 (:func:`tokencredit.engine.precision.bf16_flash_attention_broken`, "pack_vnni2 is only
    supported when avx512 is supported"). The own trainer picks the math kernel around its bf16
    forwards; verl's engines run theirs (a bf16 critic or reference) outside it, so there the
    choice is made for the process. Nothing changes anywhere else."""
    from ..engine.precision import bf16_flash_attention_broken

    if bf16_flash_attention_broken():
        torch.backends.cuda.enable_flash_sdp(False)  # the flags scaled_dot_product_attention reads on CPU too
        torch.backends.cuda.enable_mem_efficient_sdp(False)


def install() -> None:
    """Register the platform's engines and rollout and patch the two CUDA assumptions (idempotent)."""
    _math_attention_where_flash_is_broken()
    _patch_process_group()
    _patch_critic_loader()
    _register_engines_for_cpu()
    _patch_offload_pinning()
    _register_rollout()


install()
