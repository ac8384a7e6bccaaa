"""Exercise 02's functions in a file named for exercise 01."""
# expect-status: unusable
# expect-problem: looks like exercise 02


def shard_indices(num_samples, rank, world_size, epoch=0, seed=0, shuffle=True):
    return list(range(rank, num_samples, world_size))


def make_dataloader(dataset, rank, world_size, batch_size, seed=0):
    raise NotImplementedError
