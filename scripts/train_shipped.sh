#!/usr/bin/env bash
# How the drafters shipped for the embedded SmolLM2-135M-Instruct were trained (CPU, 2 cores).
# Run from the repository root after scripts/setup.sh; BENCHMARKS.md records what it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SPECDEC=.venv/bin/specdec
# 1. The prompt set (made here from the standard library's docstrings and templates; no
#    benchmark or public evaluation prompts): 2400 prompts, the last 16 held out.
$PY scripts/make_train_prompts.py --out train_prompts/prompts.jsonl --count 2400 --seed 0
# 2. draft_target: the target answers the first ${DT_SAMPLES:-2384} prompts (bfloat16, greedy,
#    160 tokens), a 2-layer draft learns them.
$SPECDEC train draft_target --data train_prompts/prompts.jsonl --out .train/draft_target \
    --max-samples "${DT_SAMPLES:-2384}" --epochs "${DT_EPOCHS:-4}" --batch-size 8 --lr 1e-3 \
    --set draft_layers=2 --set draft_vocab_size=8192 ${RESUME:+--resume}
dest=plugins/spec_draft_target/specdec_draft_target/weights/smollm2-135m-instruct
mkdir -p "$dest"
cp .train/draft_target/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
# its matrices are stored as int8 rows + scales (7 MB instead of 14; same held-out acceptance)
$PY scripts/store_int8.py "$dest/model.safetensors"
# 3. eagle3: the same answers (copied, not generated again); the target's hidden states of
#    layers 1, 14, 26 and the final norm are computed once into .train/eagle3/features.
mkdir -p .train/eagle3 .train/eagle
cp -n .train/draft_target/samples.jsonl .train/eagle3/ || true
$SPECDEC train eagle3 --data train_prompts/prompts.jsonl --out .train/eagle3 --epochs "${EAGLE_EPOCHS:-3}" \
    --batch-size 8 --lr 1e-3 --set draft_vocab_size=4096 ${RESUME:+--resume}
# 4. eagle (EAGLE-1): same answers, reading the final-norm features eagle3's store holds.
cp -n .train/draft_target/samples.jsonl .train/eagle/ || true
ln -sfn ../eagle3/features .train/eagle/features
$SPECDEC train eagle --data train_prompts/prompts.jsonl --out .train/eagle --epochs "${EAGLE_EPOCHS:-3}" \
    --batch-size 8 --lr 1e-3 ${RESUME:+--resume}
for gen in eagle eagle3; do
    dest=plugins/spec_eagle/specdec_eagle/weights/smollm2-135m-instruct-$gen
    mkdir -p "$dest"
    cp .train/$gen/{config.json,model.safetensors} "$dest/"
done
# EAGLE-3's matrices as int8 rows + scales (7.6 MB instead of 15.0; held-out acceptance 1.648 either way)
$PY scripts/store_int8.py plugins/spec_eagle/specdec_eagle/weights/smollm2-135m-instruct-eagle3/model.safetensors
# 5. medusa: three heads sharing the target's LM head, on the same answers and the
#    final-norm features of eagle3's store.
mkdir -p .train/medusa
cp -n .train/draft_target/samples.jsonl .train/medusa/ || true
ln -sfn ../eagle3/features .train/medusa/features
$SPECDEC train medusa --data train_prompts/prompts.jsonl --out .train/medusa --epochs "${MEDUSA_EPOCHS:-3}" \
    --batch-size 8 --lr 1e-3 ${RESUME:+--resume}
dest=plugins/spec_medusa/specdec_medusa/weights/smollm2-135m-instruct-medusa
mkdir -p "$dest"
cp .train/medusa/{config.json,medusa_lm_head.safetensors,draft_vocab.safetensors} "$dest/"
# 6. redrafter: a recurrent drafter (rnn, 2 ResBlocks, sharing the target's LM head) on the
#    same answers and the final-norm features of eagle3's store.
mkdir -p .train/redrafter
cp -n .train/draft_target/samples.jsonl .train/redrafter/ || true
ln -sfn ../eagle3/features .train/redrafter/features
$SPECDEC train redrafter --data train_prompts/prompts.jsonl --out .train/redrafter --epochs "${REDRAFTER_EPOCHS:-3}" \
    --batch-size 8 --lr 1e-3 ${RESUME:+--resume}
dest=plugins/spec_redrafter/specdec_redrafter/weights/smollm2-135m-instruct-redrafter
mkdir -p "$dest"
cp .train/redrafter/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
# 7. mtp: one DeepSeek-V3-style MTP module (a Llama block started from the target's last
#    layer, the target's LM head over the answers' 8192 most frequent tokens) on the same
#    answers; its own store of final-norm features (the module reads nothing else).
mkdir -p .train/mtp
cp -n .train/draft_target/samples.jsonl .train/mtp/ || true
$SPECDEC train mtp --data train_prompts/prompts.jsonl --out .train/mtp --max-samples "${DT_SAMPLES:-2384}" \
    --epochs "${MTP_EPOCHS:-3}" --batch-size 8 --lr 1e-3 ${RESUME:+--resume}
dest=plugins/spec_mtp/specdec_mtp/weights/smollm2-135m-instruct-mtp
mkdir -p "$dest"
cp .train/mtp/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 8. the MTP module fine-tuned on requests the target wrote itself: 2951 of them
#    (scripts/make_self_instruct_prompts.py; none on a benchmark prompt's topic), answered in
#    128 tokens, two epochs from the module of step 7 (`--init default`) at a third of its lr.
$PY scripts/make_self_instruct_prompts.py --out train_prompts/self_instruct.jsonl --count 3000 --seed 1
$SPECDEC train mtp --data train_prompts/self_instruct.jsonl --out .train/mtp_si --init default \
    --epochs "${MTP_SI_EPOCHS:-2}" --batch-size 8 --lr 3e-4 --max-new-tokens 128 --gen-batch-size 32 \
    ${RESUME:+--resume}
cp .train/mtp_si/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 9. EAGLE-3 again, learnt from the default target (w4a8) as users run it: its answers
#    (greedy, 160 tokens) and features to the first 1600 templated and the first 1600
#    self-written prompts, shuffled (seed 0), the 16 templated held-out prompts last;
#    3 epochs (1200 steps). It replaces step 3's head, which learnt the bfloat16 target.
$PY scripts/make_mixed_prompts.py --take train_prompts/prompts.jsonl:1600 \
    --take train_prompts/self_instruct.jsonl:1600 --held-out train_prompts/prompts.jsonl --seed 0 \
    --out .train/w4a8/mixed.jsonl
$SPECDEC train eagle3 --data .train/w4a8/mixed.jsonl --out .train/w4a8/eagle3 --quantization w4a8 \
    --epochs "${EAGLE_EPOCHS:-3}" --batch-size 8 --lr 1e-3 --set draft_vocab_size=4096 --gen-batch-size 32 \
    --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_eagle/specdec_eagle/weights/smollm2-135m-instruct-eagle3
cp .train/w4a8/eagle3/{config.json,model.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 10. Medusa again, on step 9's answers and the final-norm states of its feature store (the
#     w4a8 target's); 3 epochs (1200 steps). It replaces step 5's heads.
mkdir -p .train/w4a8/medusa
cp -n .train/w4a8/eagle3/samples.jsonl .train/w4a8/medusa/ || true
ln -sfn ../eagle3/features .train/w4a8/medusa/features
$SPECDEC train medusa --data .train/w4a8/mixed.jsonl --out .train/w4a8/medusa --quantization w4a8 \
    --epochs "${MEDUSA_EPOCHS:-3}" --batch-size 8 --lr 1e-3 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_medusa/specdec_medusa/weights/smollm2-135m-instruct-medusa
cp .train/w4a8/medusa/{config.json,medusa_lm_head.safetensors,draft_vocab.safetensors} "$dest/"
# 11. MTP again: step 8's module fine-tuned (`--init default`) on step 9's answers and the
#     final-norm states of its feature store (the w4a8 target's), 2 epochs (800 steps) at
#     step 8's lr. It replaces step 8's module.
mkdir -p .train/w4a8/mtp
cp -n .train/w4a8/eagle3/samples.jsonl .train/w4a8/mtp/ || true
ln -sfn ../eagle3/features .train/w4a8/mtp/features
$SPECDEC train mtp --data .train/w4a8/mixed.jsonl --out .train/w4a8/mtp --quantization w4a8 --init default \
    --epochs "${MTP_EPOCHS:-2}" --batch-size 8 --lr 3e-4 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_mtp/specdec_mtp/weights/smollm2-135m-instruct-mtp
cp .train/w4a8/mtp/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 12. EAGLE-3 once more, on the w4a8 target's answers (160 tokens) and features to 3,785
#     prompts step 9 left out (self-written prompts 1600-2950, the second self-written set's
#     first 1650, templated prompts 1600-2383; shuffled, seed 1), fine-tuned from step 9's
#     head (`--init default`) 2 epochs at half its lr. It replaces step 9's head.
$PY scripts/make_mixed_prompts.py --take train_prompts/self_instruct.jsonl:1600-2951 \
    --take train_prompts/self_instruct_2.jsonl:1650 --take train_prompts/prompts.jsonl:1600-2384 \
    --held-out train_prompts/prompts.jsonl --seed 1 --out .train/w4a8b/mixed.jsonl
$SPECDEC train eagle3 --data .train/w4a8b/mixed.jsonl --out .train/w4a8b/eagle3 --quantization w4a8 --init default \
    --epochs "${EAGLE_EPOCHS:-2}" --batch-size 8 --lr 5e-4 --max-new-tokens 160 --set draft_vocab_size=4096 \
    --gen-batch-size 32 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_eagle/specdec_eagle/weights/smollm2-135m-instruct-eagle3
cp .train/w4a8b/eagle3/{config.json,model.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 13. MTP once more: step 11's module fine-tuned (`--init default`) on step 12's answers and
#     the final-norm states of its feature store, 1 epoch at step 11's lr. It replaces step
#     11's module.
mkdir -p .train/w4a8b/mtp
cp -n .train/w4a8b/eagle3/samples.jsonl .train/w4a8b/mtp/ || true
ln -sfn ../eagle3/features .train/w4a8b/mtp/features
$SPECDEC train mtp --data .train/w4a8b/mixed.jsonl --out .train/w4a8b/mtp --quantization w4a8 --init default \
    --epochs "${MTP_EPOCHS:-1}" --batch-size 8 --lr 3e-4 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_mtp/specdec_mtp/weights/smollm2-135m-instruct-mtp
cp .train/w4a8b/mtp/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
# 14. EAGLE-1, ReDrafter and the draft model learnt from the default target (w4a8): each
#     shipped one fine-tuned (`--init default`) on step 12's answers (EAGLE-1 and ReDrafter on
#     the final-norm states of the w4a8 target too), 1 epoch at half its first lr. They
#     replace the drafters of steps 2, 4 and 6, which learnt the bfloat16 target.
mkdir -p .train/w4a8b/eagle .train/w4a8b/redrafter .train/w4a8b/draft_target
for run in eagle redrafter draft_target; do cp -n .train/w4a8b/eagle3/samples.jsonl .train/w4a8b/$run/ || true; done
$SPECDEC train eagle --data .train/w4a8b/mixed.jsonl --out .train/w4a8b/eagle --quantization w4a8 --init default \
    --epochs "${EAGLE_EPOCHS:-1}" --batch-size 8 --lr 5e-4 --max-new-tokens 160 --gen-batch-size 32 \
    --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_eagle/specdec_eagle/weights/smollm2-135m-instruct-eagle
cp .train/w4a8b/eagle/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
ln -sfn ../eagle/features .train/w4a8b/redrafter/features
$SPECDEC train redrafter --data .train/w4a8b/mixed.jsonl --out .train/w4a8b/redrafter --quantization w4a8 \
    --init default --epochs "${REDRAFTER_EPOCHS:-1}" --batch-size 8 --lr 5e-4 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_redrafter/specdec_redrafter/weights/smollm2-135m-instruct-redrafter
cp .train/w4a8b/redrafter/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$SPECDEC train draft_target --data .train/w4a8b/mixed.jsonl --out .train/w4a8b/draft_target --quantization w4a8 \
    --init default --epochs "${DT_EPOCHS:-1}" --batch-size 8 --lr 5e-4 --save-every 100 ${RESUME:+--resume}
dest=plugins/spec_draft_target/specdec_draft_target/weights/smollm2-135m-instruct
cp .train/w4a8b/draft_target/{config.json,model.safetensors,draft_vocab.safetensors} "$dest/"
$PY scripts/store_int8.py "$dest/model.safetensors"
