"""flotilla.deploy: how users start flotilla: the ``flotilla`` CLI (``serve``, ``resolve``,
``bench``, ``deploy``), Serve config files, the benchmark commands, KubeRay and container
recipes, the offline wheelhouse. Imports ``serve`` and below; nothing imports it."""
