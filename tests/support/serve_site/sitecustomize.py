"""On ``PYTHONPATH`` for the processes of a Ray Serve LLM test cluster (raylets, replicas and the
engine processes vLLM spawns from them, which nothing else reaches): the torchvision shim of
``tests/support/vllm_mm_models.py``, installed lazily. vLLM's LLaVA imports
``transformers.models.pixtral.image_processing_pixtral`` (torchvision's backend); where
torchvision does not import, that one name is answered with transformers' PIL module for Pixtral
(which holds the same ``_num_image_tokens``), and only when something imports it, so the
cluster's other processes pay nothing."""

import importlib
import importlib.abc
import importlib.util
import sys

_NAME = "transformers.models.pixtral.image_processing_pixtral"
_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"


class _PixtralWithoutTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != _NAME or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(_PIL)

    def exec_module(self, module):
        sys.modules[_NAME] = module


sys.meta_path.insert(0, _PixtralWithoutTorchvision())
