"""Saves one model over and over to PATH (`python save_loop_script.py PATH`): every weight of version k
is k, and "saved k" is printed once version k is on disk. tests/keras/test_model_io.py SIGKILLs it
in the middle of a save."""

import sys

import torch

import stratagem as sg


def main() -> None:
    torch.set_num_threads(1)
    module = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])
    model = sg.Model(module)
    model.compile("sgd", loss="mse")
    for version in range(1000):
        with torch.no_grad():
            for param in module.parameters():
                param.fill_(version)
        model.save(sys.argv[1])
        print(f"saved {version}", flush=True)


if __name__ == "__main__":
    main()
