"""`python -m infer.profile_cycle` times every drafter generation's pieces as the generation names them
(`Generation.timed_pieces`), with its block (`Generation.drafter_slots`) and its proposal."""
import pytest


@pytest.mark.slow  # make test-all: three generations' cycles compiled
def test_every_generation_is_profiled_with_its_own_pieces(capsys):
    from infer.profile_cycle import main

    main(["--random-target", "smollm2-135m", "--layers", "2", "--dtype", "float32", "--batch", "1",
          "--capacity", "128", "--fill", "32", "--block", "4", "--draft-layers", "1",
          "--generation", "dflash", "dflash2", "dspark", "--warmup", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    for piece in ("dflash: cycle 4", "dflash2: selector walk 3", "dflash2: cycle 4", "dspark: DSpark head 3",
                  "dspark: Markov chain 3", "dspark: cycle 4"):
        assert f"| {piece} |" in out, piece
    for generation in ("dflash", "dflash2", "dspark"):
        assert f"paired ({generation}: cycle 4 and an AR step" in out, generation
