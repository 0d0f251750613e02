package kube

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// FuzzPodEndpoints: whatever a Pod's annotations, labels and IP say,
// podEndpoints returns either a record error or endpoints that pass the
// endpoint set's validation.
func FuzzPodEndpoints(f *testing.F) {
	f.Add("10.0.0.1", "m1,m2", "lora-a", "vllm", "16", "8192", "2", "9100", "5557", "5558", "llama", 8000, 8001)
	f.Add("fd00::1", "", "", "SGLang", "0", "x", "-1", "70000", "65535", "1", "", 65535, 1)
	f.Add("::ffff:10.0.0.1", " , ,m", ",", "", "1048577", "", "65537", "", "", "", "m", 0, 80)
	f.Fuzz(func(t *testing.T, ip, models, adapters, engine, blockSize, batched, dp, metricsPort, kvPort, replayPort, modelLabel string, port1, port2 int) {
		ann := map[string]string{AnnotationModels: models, AnnotationAdapters: adapters}
		for k, v := range map[string]string{AnnotationEngine: engine, AnnotationBlockSize: blockSize,
			AnnotationMaxBatchedTokens: batched, AnnotationDataParallelSize: dp, AnnotationMetricsPort: metricsPort,
			AnnotationKVEventsPort: kvPort, AnnotationKVEventsReplay: replayPort} {
			if v != "" {
				ann[k] = v
			}
		}
		if models == "" {
			delete(ann, AnnotationModels)
		}
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "pod", Annotations: ann, Labels: map[string]string{LabelModel: modelLabel}},
			Status:     corev1.PodStatus{PodIP: ip},
		}
		var ports []int
		for _, port := range []int{port1, port2} {
			if port >= 1 && port <= 65535 && (len(ports) == 0 || ports[0] != port) {
				ports = append(ports, port)
			}
		}
		eps, err := podEndpoints(p, ports)
		if err != nil {
			if discovery.SkipReason(err) == "" {
				t.Fatalf("error without a skip reason: %v", err)
			}
			return
		}
		if len(eps) != len(ports) {
			t.Fatalf("%d endpoints for %d ports", len(eps), len(ports))
		}
		set := routing.EndpointSet{Endpoints: eps}
		if err := set.Validate(); err != nil {
			t.Fatalf("endpoints fail validation: %v", err)
		}
	})
}
