"""`python -m jax_kvalloc` runs the `jax-kvalloc` command."""
from jax_kvalloc.tools.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
