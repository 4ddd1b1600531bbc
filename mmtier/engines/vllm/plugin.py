"""mmtier's vLLM general plugin (entry point ``vllm.general_plugins``: ``mmtier``).

vLLM calls every general plugin in each of its processes before it builds a config, an engine
core or a worker (``vllm.plugins.load_general_plugins``: in ``EngineArgs``, ``EngineCore``,
``WorkerBase`` and the model registry's inspection subprocess), so this runs in a Ray Serve LLM
replica, in vLLM's spawned engine-core process, in its Ray or ``mp`` workers and in the
registry's subprocess, each time before vLLM imports a model's module.

What it does: ``torchvision_free_vllm()``. vLLM's ``llava`` module imports its ``pixtral``
module, which imports ``_num_image_tokens`` from
``transformers.models.pixtral.image_processing_pixtral``, the torchvision backend of Pixtral's
image processor, whose first lines import torchvision. Where torchvision cannot be imported
(vLLM's CPU build here: PyPI's torchvision is a CUDA build that breaks beside CPU torch), that
module name is bound to transformers' PIL module for Pixtral, which holds the same
``_num_image_tokens`` and nothing of torchvision (vLLM uses nothing else of it for LLaVA).
The same call gives Qwen2-VL / Qwen2.5-VL what they need without torchvision
(``_torchvision_free_qwen2_vl``): vLLM's ``qwen2_vl`` module imports ``smart_resize`` from the
torchvision image processor's module (bound to its PIL twin), and the model's processor loads a
video processor, which transformers has only over torchvision (mmtier's
``qwen2_vl_video.Qwen2VLVideoProcessorPil`` is bound in and registered in its place).
Where torchvision imports, it does nothing. Nothing of vLLM is imported for it.

It also calls ``threads.same_threads_as_without_a_connector()``: an engine with mmtier's KV
connector binds as many OpenMP threads on vLLM's CPU build as the same engine without it (vLLM
keeps a core back for any KV connector, which moves bf16 answers).

``shim_state()`` tells whether the binding is in place and whether vLLM's LLaVA module was
imported before it (then the shim came too late, which the tests check never happens)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

PIXTRAL = "transformers.models.pixtral.image_processing_pixtral"
PIXTRAL_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"
LLAVA = "vllm.model_executor.models.llava"
QWEN2_VL_IMAGES = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
QWEN2_VL_IMAGES_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
QWEN2_VL_VIDEOS = "transformers.models.qwen2_vl.video_processing_qwen2_vl"

_LLAVA_BEFORE: list[bool] = []            # per call of register(): was LLaVA imported already


@dataclass(frozen=True)
class ShimState:
    bound: bool                 # the Pixtral module name is bound to its PIL twin
    torchvision: bool           # torchvision imports (no shim needed)
    llava_before_plugin: bool   # vLLM's LLaVA module was imported before the plugin ran


def torchvision_free_vllm() -> None:
    """Bind Pixtral's torchvision image-processing module name to its PIL twin, and give
    Qwen2-VL a torchvision-free image and video processor, where torchvision cannot be
    imported (see the module docstring). Idempotent."""
    if PIXTRAL in sys.modules:
        return
    if _torchvision_imports():
        return
    sys.modules[PIXTRAL] = importlib.import_module(PIXTRAL_PIL)
    _torchvision_free_qwen2_vl()


def _torchvision_free_qwen2_vl() -> None:
    """Qwen2-VL without torchvision (vLLM's ``qwen2_vl`` / ``qwen2_5_vl`` modules and the
    model's processor):

    - the torchvision image-processing module name is bound to its PIL twin (vLLM imports
      ``smart_resize`` from it; transformers already falls back to the PIL class);
    - the video-processing module name is bound to a module holding mmtier's
      ``Qwen2VLVideoProcessorPil`` under transformers' name, which is also registered as Qwen2-VL's
      and Qwen2.5-VL's video processor (``AutoVideoProcessor``) so the processor loads it;
    - ``VideoProcessorMixin``, which transformers exports only with torchvision, is exported
      to the module ``ProcessorMixin`` checks a video processor's class against."""
    import types

    import transformers.processing_utils as processing
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    from ..transformers.qwen2_vl_video import Qwen2VLVideoProcessorPil

    sys.modules[QWEN2_VL_IMAGES] = importlib.import_module(QWEN2_VL_IMAGES_PIL)
    videos = types.ModuleType(QWEN2_VL_VIDEOS)
    videos.Qwen2VLVideoProcessor = videos.Qwen2VLVideoProcessorPil = Qwen2VLVideoProcessorPil
    sys.modules[QWEN2_VL_VIDEOS] = videos
    processing.transformers_module.VideoProcessorMixin = VideoProcessorMixin
    for config in (Qwen2VLConfig, Qwen2_5_VLConfig):
        AutoVideoProcessor.register(config, Qwen2VLVideoProcessorPil, exist_ok=True)


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    _LLAVA_BEFORE.append(LLAVA in sys.modules)
    torchvision_free_vllm()
    from .threads import same_threads_as_without_a_connector

    same_threads_as_without_a_connector()


def shim_state() -> ShimState:
    bound = getattr(sys.modules.get(PIXTRAL), "__name__", None) == PIXTRAL_PIL
    return ShimState(bound=bound, torchvision=_torchvision_imports(),
                     llava_before_plugin=any(_LLAVA_BEFORE))


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
    except (ImportError, RuntimeError):       # absent, or a CUDA build beside CPU torch
        return False
    return True
