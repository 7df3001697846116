"""A user's training step, as tests write it over and over: forward, loss, backward, SGD
update, zero_grad."""

import torch
import torch.nn.functional as F


def sgd_step(model, loss_fn=F.mse_loss, **sgd_options):
    """``step(x, y)`` training ``model`` with SGD(``sgd_options``); returns the detached loss."""
    opt = torch.optim.SGD(model.parameters(), **sgd_options)

    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def train_step(model, opt, x, y):
    """The step as a function of its model, optimizer and batch: MSE, backward, step, zero_grad."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
