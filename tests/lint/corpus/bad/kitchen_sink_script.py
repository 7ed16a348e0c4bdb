# expect: LK001, LK002, LK006, LK007
"""A module-level tutorial script with several habits at once."""
import torch
import torchvision
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
transform = torchvision.transforms.ToTensor()
trainset = torchvision.datasets.CIFAR10(root="./data", train=True, download=True, transform=transform)
testset = torchvision.datasets.CIFAR10(root="./data", train=False, download=True, transform=transform)
trainloader = torch.utils.data.DataLoader(trainset, batch_size=4, shuffle=True, num_workers=2, worker_init_fn=None, generator=torch.Generator().manual_seed(0))  # <- LK007
testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)  # read once, after training: no finding

net = nn.DataParallel(torchvision.models.resnet18(num_classes=10)).to(device)  # <- LK006
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)

epoch_losses = []
for epoch in range(2):
    running_loss = 0.0
    for i, data in enumerate(trainloader, 0):
        inputs, labels = data[0].to(device), data[1].to(device)
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()  # <- LK002
        if i % 2000 == 1999:
            print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 2000:.3f}")
            running_loss = 0.0
        epoch_losses.append(loss)  # <- LK001

net.eval()
correct = 0
for images, labels in testloader:
    outputs = net(images.to(device))  # one test pass after training: its graphs, once
    correct += (outputs.argmax(1) == labels.to(device)).sum().item()
print(f"accuracy {100 * correct / len(testset):.1f}%")
