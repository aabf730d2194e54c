"""The sglang-jax flavour of jax_kvalloc's classes (SPEC 15), and patch() / unpatch().

Modules::

  allocators.py    TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator and
                   SWATokenToKVPoolAllocator with sglang-jax's constructors, signatures,
                   attributes and NumPy results, over jax_kvalloc.sglang's pools
                   (backend="host" by default, "device" available; guard=True)
  patching.py      patch(backend="host", guard=True) / unpatch(): sglang-jax's engine
                   and tests allocate through these classes
  startup.py       the environment switch JAX_KVALLOC_SGL_JAX=host|device, run at
                   interpreter start by jax_kvalloc_sgl_jax.pth (`python -m
                   jax_kvalloc.sgl_jax --install-pth` puts it in site-packages)
  pytest_check.py  pytest plugin: a refusal still pending at a test's end fails it

sglang-jax stays optional: nothing here imports sgl_jax until patch() is called.
"""
from jax_kvalloc.sgl_jax.allocators import PagedTokenToKVPoolAllocator
from jax_kvalloc.sgl_jax.allocators import SWATokenToKVPoolAllocator
from jax_kvalloc.sgl_jax.allocators import TokenToKVPoolAllocator
from jax_kvalloc.sgl_jax.patching import patch
from jax_kvalloc.sgl_jax.patching import patched
from jax_kvalloc.sgl_jax.patching import unpatch

__all__ = ["PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator",
           "TokenToKVPoolAllocator", "patch", "patched", "unpatch"]
