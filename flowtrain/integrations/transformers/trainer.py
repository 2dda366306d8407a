"""flowtrain's Trainer: Hugging Face's ``transformers.Trainer`` with the model trained by
flowtrain's engine. HF's loop, data loading, logging, callbacks and evaluation stay; the
engine, built by ``flowtrain.initialize`` from the arguments' config, does the forward, backward
and optimizer step (accumulation, mixed precision, clipping, ZeRO 0-3, offload), writes and
resumes its checkpoints, and gathers the whole model for ``save_model``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import transformers

from flowtrain.config.hf import check_against_arguments, config_of, read_raw, trainer_auto_values

if TYPE_CHECKING:
    from flowtrain.engine.engine import FlowtrainEngine


class SteppedByEngine:
    """Stands in for the engine's optimizer or lr scheduler in HF's loop, which steps both after
    each accumulation boundary: the engine has already stepped them inside its own ``step()``,
    so ``step()`` here does nothing. Every other attribute is the real object's."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name == "target":  # not set yet (copy, unpickling): no recursion through target
            raise AttributeError(name)
        return getattr(self.target, name)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on flowtrain's engine: take it in place of HF's, with
    ``flowtrain.integrations.transformers.TrainingArguments(deepspeed=config)``; a config's
    "auto" values are filled from the arguments as HF's Trainer fills them for DeepSpeed.

    The engine is built at the first ``train()`` (``engine``); a config without an
    ``optimizer`` (``scheduler``) section trains with HF's own optimizer (scheduler), as HF's
    DeepSpeed route does. Checkpoints (``save_steps``) hold HF's files plus the engine's
    checkpoint, which ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end``
    restore exactly; ``save_model`` writes the whole model (gathered under ZeRO-3) as HF files;
    ``evaluate``/``predict`` after training run through the engine."""

    # Read by methods HF's __init__ already calls; set by the first train().
    engine: FlowtrainEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config_of(self.args)  # arguments meant for DeepSpeed are refused now, not after loading

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        # The engine casts, scales and unscales: accelerate's autocast and GradScaler would do
        # it a second time around the engine's forward and backward.
        out["mixed_precision"] = "no"
        plugin = out.get("gradient_accumulation_plugin")
        if plugin is not None:
            # The engine decides when gradients are reduced (at the accumulation boundary, or
            # each micro-batch under ZeRO 2-3): HF's loop must not wrap micro-batches in the
            # model's no_sync, which ZeRO 2-3 refuses.
            plugin.sync_each_batch = True
        return out

    # -- the engine ------------------------------------------------------------------------------

    def build_engine(self, max_steps: int) -> Any:
        """``flowtrain.initialize`` on the model with the arguments' config, its "auto"
        values filled from the arguments for a run of ``max_steps`` optimizer steps."""
        import flowtrain

        config = config_of(self.args)
        values = trainer_auto_values(self.args, max_steps, self.args.world_size)
        check_against_arguments(config, values)
        raw = read_raw(config) or {}
        optimizer: Any = None
        if "optimizer" in raw:
            if self.optimizer is not None:
                raise ValueError("the config has an 'optimizer' section and the Trainer was "
                                 "given optimizers=(optimizer, ...): keep one of the two")
        else:
            optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
        scheduler: Any = None
        if "scheduler" not in raw:
            # HF's scheduler, built on the optimizer as the engine holds it
            scheduler = self.lr_scheduler if self.lr_scheduler is not None else \
                (lambda opt: self.create_scheduler(max_steps, optimizer=opt))
        engine, *_ = flowtrain.initialize(model=self.model, optimizer=optimizer,
                                          lr_scheduler=scheduler, config=config,
                                          auto_values=values)
        return engine

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> tuple[Any, Any]:
        # A second train() goes on with the same engine: under ZeRO-3 the model it was built on
        # is already partitioned and cannot be handed to a new one.
        if self.engine is None:
            self.engine = self.build_engine(max_steps)
        engine = self.engine
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(str(resume_from_checkpoint))
            if path is None:
                raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} holds no "
                                 f"flowtrain engine checkpoint (no 'latest' file): pass a "
                                 f"checkpoint-<step> folder this Trainer saved")
        self.model_wrapped = engine
        self.optimizer = SteppedByEngine(engine.optimizer)
        self.lr_scheduler = SteppedByEngine(engine.lr_scheduler)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        # Evaluation runs through the engine too: under ZeRO-3 only it can gather the weights.
        if self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # -- one micro-batch -------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """The forward through the engine, its backward, and its step, which acts only where
        HF's loop ends an accumulation step (the last micro-batch of the step or the epoch)."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("Trainer.training_step runs inside train(), which builds the "
                               "engine first")
        engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        # HF's rule for the loss of one micro-batch of an accumulation step: divided by the
        # step's micro-batch count unless compute_loss already normalised it (by the tokens of
        # the whole step); the engine then must not divide again.
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Any:
        # the engine clipped at its step (gradient_clipping: max_grad_norm); this is the norm
        return self.engine.get_global_grad_norm() if self.engine is not None else \
            super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    def _get_learning_rate(self) -> float:
        if self.engine is None:
            return float(super()._get_learning_rate())
        lrs = self.engine.get_lr()
        return float(lrs[0]) if lrs else 0.0

    # -- saving and resuming ---------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF's files (``from_pretrained`` loads them) with the whole model, gathered under
        ZeRO-3; every rank must call it, the saving rank writes."""
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.engine.module_state_dict()  # collective under ZeRO-3
        self._save(output_dir, state_dict=state if self.args.should_save else None)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # model, optimizer (its shards under ZeRO), scheduler, loss scale and counters
        self.engine.save_checkpoint(output_dir)

    def _load_best_model(self) -> None:
        if self.engine is None:
            super()._load_best_model()
            return
        # the engine's own checkpoint: full-precision weights, and under ZeRO-3 each rank's
        # shard (HF's path would load the 16-bit files into the module behind the engine)
        self.engine.load_checkpoint(self.state.best_model_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Nothing before the engine exists: it restores the weights with everything else from
        # its own checkpoint (_prepare_for_training), in full precision and under ZeRO-3.
        return None
