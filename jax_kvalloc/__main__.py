"""`python -m jax_kvalloc` runs the `jax-kvalloc` command (its default is `simulate`)."""
from jax_kvalloc.tools.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
