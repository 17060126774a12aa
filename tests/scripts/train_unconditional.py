"""Train a tiny unconditional diffusion model, the way diffusers' training scripts do.

Written like diffusers' ``examples/unconditional_image_generation/train_unconditional.py`` and
``examples/text_to_image/train_text_to_image.py`` (a ``UNet2DModel`` built from a small config,
random 8x8 images made here) and ported by the import only (``import accelerate`` ->
``from nbaccel import accelerate``, the README's porting rule, whose ``__version__`` is the
Accelerate API version nbaccel follows):

* save/load hooks registered only ``if version.parse(accelerate.__version__) >= "0.16.0"``; they
  write ``unet/`` and ``unet_ema/`` into each checkpoint and pop the weights Accelerate would save;
* ``accelerator.save_state`` called inside ``if accelerator.is_main_process:``;
* resume with ``--resume_from_checkpoint latest``: ``load_state``, then ``continue`` over the steps
  of the epoch the checkpoint already covers;
* at the end, inside ``if accelerator.is_main_process:``, ``save_model`` of the unwrapped model and
  the EMA weights saved beside it, then the pipeline (EMA weights) with ``save_pretrained``.

Rank 0 writes the run's facts to ``--output_dir/result-<phase>.json``.
"""

import argparse
import json
import math
import os

import safetensors.torch
import torch
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from packaging import version
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, accelerate
from nbaccel.logging import get_logger
from nbaccel.utils import ProjectConfiguration, set_seed

logger = get_logger(__name__, log_level="INFO")


def build_unet():
    return UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_batch_size", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=5)
    parser.add_argument("--num_epochs", type=int, default=10)
    parser.add_argument("--checkpointing_steps", type=int, default=3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--resume_from_checkpoint", default=None)
    args = parser.parse_args()

    logging_dir = os.path.join(args.output_dir, "logs")
    accelerator_project_config = ProjectConfiguration(
        project_dir=args.output_dir, logging_dir=logging_dir
    )
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision="no",
        log_with="tensorboard",
        project_config=accelerator_project_config,
    )
    logger.info(accelerator.state, main_process_only=False)
    set_seed(0)

    model = build_unet()
    ema_model = EMAModel(
        model.parameters(),
        decay=0.9,
        use_ema_warmup=False,
        model_cls=UNet2DModel,
        model_config=model.config,
    )
    facts = {"hooks_registered": False, "save_hook_calls": 0, "load_hook_calls": 0}

    # `accelerate` 0.16.0 will have better support for customized saving
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):

        def save_model_hook(models, weights, output_dir):
            facts["save_hook_calls"] += 1
            if accelerator.is_main_process:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
                for i, model in enumerate(models):  # noqa: B007 - as diffusers writes it
                    model.save_pretrained(os.path.join(output_dir, "unet"))
                    # make sure to pop weight so that corresponding model is not saved again
                    weights.pop()

        def load_model_hook(models, input_dir):
            facts["load_hook_calls"] += 1
            load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(load_model.state_dict())
            del load_model
            for i in range(len(models)):  # noqa: B007 - as diffusers writes it
                # pop models so that they are not loaded again
                model = models.pop()
                load_model = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
                model.register_to_config(**load_model.config)
                model.load_state_dict(load_model.state_dict())
                del load_model

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)
        facts["hooks_registered"] = True

    noise_scheduler = DDPMScheduler(num_train_timesteps=50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.rand(16, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    train_dataloader = DataLoader(
        TensorDataset(images), batch_size=args.train_batch_size, shuffle=True
    )
    lr_scheduler = get_scheduler(
        "constant_with_warmup",
        optimizer=optimizer,
        num_warmup_steps=2 * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    if accelerator.is_main_process:
        accelerator.init_trackers("train_unconditional")

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    global_step = 0
    first_epoch = 0
    resume_step = 0
    if args.resume_from_checkpoint:
        dirs = [d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")]
        path = sorted(dirs, key=lambda x: int(x.split("-")[1]))[-1]
        accelerator.print(f"Resuming from checkpoint {path}")
        accelerator.load_state(os.path.join(args.output_dir, path))
        global_step = int(path.split("-")[1])
        resume_global_step = global_step * args.gradient_accumulation_steps
        first_epoch = global_step // num_update_steps_per_epoch
        resume_step = resume_global_step % (
            num_update_steps_per_epoch * args.gradient_accumulation_steps
        )
        facts["resumed_from"] = path
        facts["ema_optimization_step_after_load"] = ema_model.optimization_step
    ema_model.to(accelerator.device)

    steps_trained = 0
    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        for step, (clean_images,) in enumerate(train_dataloader):
            # Skip steps until we reach the resumed step
            if args.resume_from_checkpoint and epoch == first_epoch and step < resume_step:
                continue
            noise = torch.randn(clean_images.shape, device=clean_images.device)
            timesteps = torch.randint(0, 50, (clean_images.shape[0],), device=clean_images.device)
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                ema_model.step(model.parameters())
                global_step += 1
                steps_trained += 1
                if accelerator.is_main_process:  # noqa: SIM102 - as diffusers writes it
                    if global_step % args.checkpointing_steps == 0:
                        save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                        accelerator.save_state(save_path)
                        logger.info(f"Saved state to {save_path}")
            accelerator.log(
                {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0]},
                step=global_step,
            )
            if global_step >= args.max_train_steps:
                break
        if global_step >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unet = accelerator.unwrap_model(model)
        final_dir = os.path.join(args.output_dir, "final")
        accelerator.save_model(unet, final_dir)
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
        ema_state = {k: v.detach().clone().contiguous() for k, v in unet.state_dict().items()}
        safetensors.torch.save_file(ema_state, os.path.join(final_dir, "model_ema.safetensors"))
        pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
        pipeline.save_pretrained(args.output_dir)
        ema_model.restore(unet.parameters())
        # a second save_model (e.g. at the end of a resumed run) keeps the EMA file beside it
        accelerator.save_model(unet, final_dir)
        facts.update(
            global_step=global_step,
            steps_trained=steps_trained,
            ema_optimization_step=ema_model.optimization_step,
            checkpoints=sorted(
                d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")
            ),
        )
        phase = "resume" if args.resume_from_checkpoint else "first"
        with open(os.path.join(args.output_dir, f"result-{phase}.json"), "w") as f:
            json.dump(facts, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
