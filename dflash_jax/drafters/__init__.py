"""The drafters: the DFlash drafter (`drafter`) and its config (`config`), the drafter generations
(`generations`: DFlash, DFlash2, DSpark, each with its own heads, proposal, loss and checkpoint names;
`dflash2` and `dspark` hold their math), the reduced draft vocabulary (`draft_vocab`) and the training
objective (`objective`)."""
