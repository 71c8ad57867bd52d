"""Training on DeepSpeed ZeRO: one loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq``.

``config``      the DeepSpeed config, AdamW parameter groups and the lr schedule, all from the recipe
``checkpoint``  save / find / load checkpoints (DeepSpeed's plus our self-describing metadata)
``loop``        the training loop (``train(recipe, stage)``) and the three stages' set-up
``packing``     the named step vector: the model's log keys, statistics and the loop's flags
``metrics``     metrics.jsonl, TensorBoard, the MFU peak, plots
``display``     the rich live display on stderr

Nothing here is imported by ``ncpctl --help``; torch and DeepSpeed load inside these modules.
"""
