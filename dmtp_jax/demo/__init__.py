"""The shipped demo: stdlib corpus + tokenizer (`corpus`), joint target + MTP pretraining
(`pretrain`, `build`: `train.py pretrain`), model cards (`cards`)."""
