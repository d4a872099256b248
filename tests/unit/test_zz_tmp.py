import time, torch
from fusion.models import build_model
def test_t():
    r = build_model("resnet","tiny",num_classes=4).eval(); x = torch.randn(2,3,16,16)
    for i in range(4):
        t=time.time()
        with torch.no_grad(): r(x)
        print(i, time.time()-t, torch.get_num_threads())
