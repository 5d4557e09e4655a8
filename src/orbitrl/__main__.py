from orbitrl.cli import entry

entry()
