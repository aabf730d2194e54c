"""`python -m jax_kvalloc.sgl_jax --install-pth`: writes jax_kvalloc_sgl_jax.pth (the
environment switch, see jax_kvalloc.sgl_jax.startup) into this interpreter's
site-packages and prints its path. The line imports nothing unless
JAX_KVALLOC_SGL_JAX is set."""
import argparse
import os
import sysconfig

PTH_NAME = "jax_kvalloc_sgl_jax.pth"
PTH_LINE = ('import os; os.environ.get("JAX_KVALLOC_SGL_JAX") and '
            '__import__("jax_kvalloc.sgl_jax.startup")\n')


def install_pth(directory: str = "") -> str:
  """Writes the .pth into `directory` (default: site-packages); returns its path."""
  path = os.path.join(directory or sysconfig.get_paths()["purelib"], PTH_NAME)
  with open(path, "w", encoding="utf-8") as f:
    f.write(PTH_LINE)
  return path


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m jax_kvalloc.sgl_jax")
  parser.add_argument("--install-pth", action="store_true", required=True,
                      help=f"write {PTH_NAME} into site-packages")
  parser.add_argument("--dir", default="", help="where instead of site-packages")
  args = parser.parse_args()
  print(install_pth(args.dir))


if __name__ == "__main__":
  main()
