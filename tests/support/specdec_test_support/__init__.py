"""specdec's own test fixtures, installed by ``scripts/setup.sh`` beside the package and not
shipped with it: checks on the embedded model (:mod:`.embedded`) and a served engine
(:mod:`.served`)."""
