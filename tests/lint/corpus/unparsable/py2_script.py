# A Python 2 training script: it does not parse under Python 3 and must be skipped.
import torch

for epoch in range(10):
    loss = train_epoch(model, loader)
    print "epoch %d loss %f" % (epoch, loss.data[0])
