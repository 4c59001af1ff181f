"""A training script written against Horovod's PyTorch API, in Horovod's call styles.

Only the import differs from a Horovod script; the test runs it at 1, 2 and 4 ranks.
"""

import argparse

import torch
import torch.nn.functional as F

import totalreduce.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--fp16-allreduce", action="store_true")
args = parser.parse_args([])

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

# Synthetic data set; each rank takes its shard (what DistributedSampler would do).
g = torch.Generator().manual_seed(0)
features = torch.randn(512, 10, generator=g)
labels = (features[:, 0] + features[:, 1] > 0).long()
shard = torch.arange(hvd.rank(), len(features), hvd.size())
train_x, train_y = features[shard], labels[shard]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 32)
        self.fc2 = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


model = Net()
# Horovod: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)

resume_from_epoch = hvd.broadcast_object(0, root_rank=0, name="resume_from_epoch")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


for epoch in range(resume_from_epoch, args.epochs):
    model.train()
    for i in range(0, len(train_x), args.batch_size):
        optimizer.zero_grad()
        output = model(train_x[i:i + args.batch_size])
        loss = F.cross_entropy(output, train_y[i:i + args.batch_size])
        loss.backward()
        optimizer.step()
    scheduler.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(train_x).argmax(1) == train_y).float().mean().item()
    accuracy = metric_average(accuracy, "avg_accuracy")
    handle = hvd.allreduce_async_(torch.tensor([loss.item()]), name="loss", op=hvd.Sum)
    total_loss = hvd.synchronize(handle)
    if hvd.rank() == 0:
        print(f"epoch {epoch} accuracy {accuracy:.3f} loss {total_loss.item():.4f}")

# Every rank must end with the same weights.
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(weights.unsqueeze(0), name="final_weights")
assert torch.equal(gathered.min(0).values, gathered.max(0).values), "weights diverged"
hvd.join()
if hvd.rank() == 0:
    print(f"done: {hvd.size()} ranks, accuracy {accuracy:.3f}")
