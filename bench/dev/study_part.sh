#!/usr/bin/env bash
# One part of a study split over GPU machines (README, "A study can be split over machines"), as run on a
# device whose results come back through $OUT: trains CONFIGS under the default MPS workers, collects them,
# optionally runs the timing pass, prints the part's wall times and packs the portable run files.
# usage: bash bench/dev/study_part.sh SHA CONFIGS [timing]
export NNRAND_GIT_SHA=$1
python3 -m pip install -q -e . --no-deps --no-build-isolation > $OUT/pip.log 2>&1
nvidia-smi -L > $OUT/smi.txt
t0=$(date +%s)
python3 -m nnrand.study --no-timing --no-progress --time-budget 455 --configs "$2" > $OUT/study.log 2>&1
t1=$(date +%s)
python3 -m nnrand.study report --configs "$2" >> $OUT/study.log 2>&1
t2=$(date +%s)
echo "study $((t1-t0)) s, collect $((t2-t1)) s" >> $OUT/study.log
if [ "$3" = timing ]; then
  python3 -m nnrand.study timing > $OUT/timing.log 2>&1
  cp reports/results/divergence_timing.json $OUT/
  echo "timing $(( $(date +%s) - t2 )) s" >> $OUT/study.log
fi
tar czf - --exclude='weights_epoch_*' --exclude=checkpoint.pt runs/divergence | split -b 15M - $OUT/part.tgz.
ls -la $OUT >> $OUT/study.log
