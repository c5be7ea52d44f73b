# The course's JupyterHub on one server with several GPUs (lab/jupyterhub/README.md): each learner's JupyterLab a
# process of theirs on this machine, in their own folder, with one GPU of its own. Run as root (the servers run as
# the learners), from the folder that keeps the hub's database and cookie secret:
#     cd /srv/gpullm-hub && /opt/gpullm-lessons/.venv/bin/jupyterhub -f /opt/gpullm-lessons/lab/jupyterhub/config_gpu_server.py
import os

c = get_config()  # noqa: F821
load_subconfig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_base.py"))  # noqa: F821

import gpullm_hub  # noqa: E402  (beside this file: config_base.py put its folder on sys.path)

c.JupyterHub.spawner_class = gpullm_hub.CourseSpawner

# ---- the GPUs -----------------------------------------------------------------------------------------------------
# Each learner's server holds one GPU while it runs (CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES show it that one
# only); stopping the server, or the idle culler stopping it, gives it back. With every GPU held, a spawn is refused
# with a message that says so. Default: every GPU of this machine; to keep some for other work, list the others:
# c.CourseSpawner.gpus = ["0", "1", "2", "3"]
# c.CourseSpawner.learners_per_gpu = 2        # learners who share one GPU (the course's models are small)
