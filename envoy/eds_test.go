package envoy_test

import (
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kvbandit/kvbandit/routing/discovery/eds"
)

// TestEDSConfig checks what eds.yaml adds to sidecar.yaml (the worker cluster
// fed by kvbandit's EDS server), and that it adds nothing else.
func TestEDSConfig(t *testing.T) {
	edsBS := decode(t, readFile(t, "eds.yaml"))
	sidecar := decode(t, readFile(t, "sidecar.yaml"))

	if n := edsBS.GetNode(); n.GetId() == "" || n.GetCluster() == "" {
		t.Errorf("node %v: Envoy needs a node id and cluster to subscribe to xDS", n)
	}

	pool := cluster(t, edsBS, "inference_pool")
	if pool.GetType() != clusterv3.Cluster_EDS || pool.GetLoadAssignment() != nil {
		t.Errorf("inference_pool: type %v with load_assignment %v, want EDS without", pool.GetType(), pool.GetLoadAssignment())
	}
	ecc := pool.GetEdsClusterConfig()
	if got := ecc.GetServiceName(); got != eds.DefaultCluster {
		t.Errorf("service_name %q, want %q (eds.DefaultCluster)", got, eds.DefaultCluster)
	}
	src := ecc.GetEdsConfig()
	api := src.GetApiConfigSource()
	if src.GetResourceApiVersion() != corev3.ApiVersion_V3 || api.GetApiType() != corev3.ApiConfigSource_GRPC ||
		api.GetTransportApiVersion() != corev3.ApiVersion_V3 || len(api.GetGrpcServices()) != 1 ||
		api.GetGrpcServices()[0].GetEnvoyGrpc().GetClusterName() != "kvbandit_xds" {
		t.Errorf("eds_config %v: want V3 GRPC through envoy_grpc kvbandit_xds", src)
	}
	// Same override_host policy as the static sidecar.
	if want, got := overrideHost(t, cluster(t, sidecar, "inference_pool")), overrideHost(t, pool); !proto.Equal(want, got) {
		t.Errorf("override_host differs from sidecar.yaml's:\n%v\n%v", got, want)
	}

	xds := cluster(t, edsBS, "kvbandit_xds")
	if got := endpointsOf(t, xds); len(got) != 1 || got[0] != eds.DefaultAddr {
		t.Errorf("kvbandit_xds endpoints %v, want [%s] (eds.DefaultAddr)", got, eds.DefaultAddr)
	}
	var opts httpv3.HttpProtocolOptions
	if err := xds.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&opts); err != nil ||
		opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
		t.Errorf("kvbandit_xds must speak HTTP/2 (gRPC): %v %v", &opts, err)
	}

	// Everything else is sidecar.yaml.
	e, s := decode(t, readFile(t, "eds.yaml")), decode(t, readFile(t, "sidecar.yaml"))
	e.Node = nil
	e.StaticResources.Clusters = dropClusters(e.StaticResources.Clusters, "inference_pool", "kvbandit_xds")
	s.StaticResources.Clusters = dropClusters(s.StaticResources.Clusters, "inference_pool")
	if !proto.Equal(e, s) {
		t.Error("eds.yaml differs from sidecar.yaml outside node, inference_pool and kvbandit_xds; keep them in step")
	}
	// And inference_pool differs only in how it gets its hosts.
	e2, s2 := decode(t, readFile(t, "eds.yaml")), decode(t, readFile(t, "sidecar.yaml"))
	p, sp := cluster(t, e2, "inference_pool"), cluster(t, s2, "inference_pool")
	p.ClusterDiscoveryType, p.EdsClusterConfig = nil, nil
	sp.ClusterDiscoveryType, sp.LoadAssignment = nil, nil
	if !proto.Equal(p, sp) {
		t.Error("inference_pool differs from sidecar.yaml's beyond type, eds_cluster_config and load_assignment")
	}
}

func dropClusters(cs []*clusterv3.Cluster, names ...string) []*clusterv3.Cluster {
	var out []*clusterv3.Cluster
	for _, c := range cs {
		drop := false
		for _, n := range names {
			drop = drop || c.GetName() == n
		}
		if !drop {
			out = append(out, c)
		}
	}
	return out
}
