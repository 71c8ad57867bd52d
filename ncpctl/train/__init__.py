"""Training on DeepSpeed ZeRO: one loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq``.

``config``      the DeepSpeed config, AdamW parameter groups and the lr schedule, all from the recipe
``checkpoint``  save / find / load checkpoints (DeepSpeed's plus our self-describing metadata)
``loop``        the training loop (``train(recipe, stage)``); it names no design
``stages``      the three stages' set-up (``make_stage``, ``build_model``)
``data``        the splits and their loaders, checked before any heavy work
``engine``      ``Dist``, distributed init, the DeepSpeed engine, midtrain's hyperparameter reset
``hooks``       what a design adds to a run (``DesignHooks``); the shipped designs' in ``designs/``
``packing``     the named step vector: the model's log keys, statistics and the loop's flags
``metrics``     metrics.jsonl, TensorBoard, plots (the MFU peak: ``ncpctl.profile.timing``)
``tracking``    Weights & Biases (``train.wandb``): the same records, the recipe, the plots
``elastic``     resuming on another number of ranks (DeepSpeed's universal checkpoint)
``display``     the rich live display on stderr

Nothing here is imported by ``ncpctl --help``; torch and DeepSpeed load inside these modules.
"""
