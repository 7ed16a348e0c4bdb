# expect: LK004
"""A GAN loop that builds its labels and noise on the host and copies them over every step."""
import numpy as np
import torch
from torch.autograd import Variable

cuda = torch.cuda.is_available()
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor


def real_labels(n, device):
    return torch.ones(n, 1).to(device)  # <- LK004


def train(generator, discriminator, loader, opt_g, opt_d, adversarial_loss, device):
    for epoch in range(200):
        for imgs, _ in loader:
            valid = real_labels(imgs.size(0), device)
            # On a GPU run Tensor is torch.cuda.FloatTensor: sizes allocate on the device.
            fake = Variable(Tensor(imgs.size(0), 1).fill_(0.0), requires_grad=False)
            z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], 100))))  # <- LK004
            smooth = Variable(torch.FloatTensor(imgs.size(0), 1).fill_(0.9)).cuda()  # <- LK004
            gen_imgs = generator(z)
            g_loss = adversarial_loss(discriminator(gen_imgs), valid)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            real = adversarial_loss(discriminator(imgs.to(device)), smooth)
            d_loss = (real + adversarial_loss(discriminator(gen_imgs.detach()), fake)) / 2
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
