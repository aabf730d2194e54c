# Five pairs: `python -m jax_kvalloc simulate --no-progress` cold (an empty XDG_CACHE_HOME,
# so the persistent compilation cache starts empty) then warm (the same folder), from the
# repository root with PY the interpreter; logs into $D (last line: /usr/bin/time).
for i in 1 2 3 4 5; do
  export XDG_CACHE_HOME=$(mktemp -d)
  for run in cold warm; do
    PYTHONPATH=$PWD /usr/bin/time -f 'wall %e s cpu %U+%S' $PY -m jax_kvalloc simulate --no-progress > $D/$run$i.log 2>&1
  done
  rm -rf $XDG_CACHE_HOME
done
