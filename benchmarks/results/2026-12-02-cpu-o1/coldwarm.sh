# cold then warm `python -m jax_kvalloc simulate --no-progress` with a fresh XDG_CACHE_HOME per
# pair, the tree before (sources of $OLD in $OLDTREE) and this tree alternating; logs into $D.
for i in 1 2 3 4; do
  for t in old new; do
    src=$([ $t = old ] && echo $OLDTREE || echo $NEWTREE)
    export XDG_CACHE_HOME=$(mktemp -d)
    for run in cold warm; do
      (cd $src && PYTHONPATH=$src /usr/bin/time -f 'wall %e s cpu %U+%S' $PY -m jax_kvalloc simulate --no-progress) > $D/$t-$run$i.log 2>&1
    done
    rm -rf $XDG_CACHE_HOME
  done
done
