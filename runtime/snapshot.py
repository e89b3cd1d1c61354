"""One snapshot of a training run's state, for every comparison of "trained the same": the
parameters, gradients and optimizer state of the optimizers that stepped, and the ``state_dict()``
(parameters and buffers: batch norm's running statistics) of the models that ran.

``Watch`` finds both while a script runs, through PyTorch's global hooks (an optimizer's step, a
module's forward), so a script needs no change; ``state_of`` copies them. The tests, the
benchmarks and ``max-batch``'s verifying run all compare through these two, so none of them can
leave buffers out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class Watch:
    """While entered: the optimizers that stepped and the modules that ran a forward, each in the
    order first seen. ``state()`` copies their state (``state_of``)."""

    def __init__(self) -> None:
        self.optimizers: list = []
        self._ran: dict[int, torch.nn.Module] = {}
        self._handles: list = []

    def __enter__(self) -> Watch:
        from torch.nn.modules.module import register_module_forward_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def stepped(opt, args, kwargs):
            if opt not in self.optimizers:
                self.optimizers.append(opt)

        def ran(module, inputs, output):
            self._ran.setdefault(id(module), module)

        self._handles = [
            register_optimizer_step_post_hook(stepped),
            register_module_forward_hook(ran),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def models(self, script_globals: dict | None = None) -> Iterator[tuple[str, torch.nn.Module]]:
        """The outermost modules that ran (not a submodule of another), then the modules in
        ``script_globals`` not found that way; each once, named ``model{i}`` or by its global."""
        ran = list(self._ran.values())
        inner = {id(sub) for m in ran for sub in m.modules() if sub is not m}
        seen: set[int] = set()
        for m in ran:
            if id(m) not in inner and id(m) not in seen:
                yield f"model{len(seen)}", m
                seen.add(id(m))
        for name, v in (script_globals or {}).items():
            if isinstance(v, torch.nn.Module) and id(v) not in seen and id(v) not in inner:
                seen.add(id(v))
                yield name, v

    def state(self, script_globals: dict | None = None) -> dict[str, torch.Tensor]:
        return state_of(self.optimizers, self.models(script_globals))


def state_of(optimizers: Iterable, models: Iterable) -> dict[str, torch.Tensor]:
    """Copies of every parameter, gradient and optimizer state tensor of ``optimizers`` (named by
    position: ``opt{i}.g{group}.p{param}``) and of the ``state_dict()`` of each ``(name, module)``
    in ``models`` (``{name}.state_dict.{key}``)."""
    captured: dict[str, torch.Tensor] = {}
    for i, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                name = f"opt{i}.g{gi}.p{pi}"
                captured[name] = p.detach().clone()
                if p.grad is not None:
                    captured[name + ".grad"] = p.grad.detach().clone()
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        captured[f"{name}.state.{k}"] = v.detach().clone()
    for mname, m in models:
        for k, v in m.state_dict(keep_vars=True).items():
            if isinstance(v, torch.Tensor):
                captured[f"{mname}.state_dict.{k}"] = v.detach().clone()
    return captured
