// Command fake-gpu-plugin is a real node's GPUs for the tests, through the kubelet's device-plugin API
// (v1beta1), as NVIDIA's device plugin offers real ones: it registers a resource (nvidia.com/gpu) with the
// kubelet, lists -count healthy devices, and allocates them to containers the way NVIDIA's plugin does
// under the NVIDIA container runtime: NVIDIA_VISIBLE_DEVICES names the container's devices. There is no
// device behind them: the node's capacity, the scheduler's accounting and the container's environment are
// real, a CUDA call in the container would find no GPU.
//
// When the kubelet restarts it removes every socket in its device-plugin folder: the plugin sees its own
// gone and serves and registers again, as real plugins do.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change: the kubelet keeps the stream open until it goes
	return nil
}

func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ",")},
		})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func main() {
	folder := flag.String("device-plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin folder (<root-dir>/device-plugins)")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource offered")
	count := flag.Int("count", 1, "how many devices")
	prefix := flag.String("id-prefix", "GPU-fake", "device IDs are <prefix>-<index>")
	flag.Parse()
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%s-%d", *prefix, i), Health: pluginapi.Healthy})
	}
	endpoint := "unbroken-fake-gpu.sock"
	socket := filepath.Join(*folder, endpoint)
	for {
		server, err := serve(p, socket)
		if err == nil {
			err = register(filepath.Join(*folder, "kubelet.sock"), endpoint, *resource)
		}
		if err != nil {
			log.Printf("fake-gpu-plugin: %v; trying again", err)
		} else {
			log.Printf("fake-gpu-plugin: %d %s registered at %s", *count, *resource, socket)
			for exists(socket) {
				time.Sleep(500 * time.Millisecond) // the kubelet removes the socket when it restarts
			}
			log.Printf("fake-gpu-plugin: %s gone (the kubelet restarted); registering again", socket)
		}
		if server != nil {
			server.Stop()
		}
		time.Sleep(time.Second)
	}
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func serve(p *plugin, socket string) (*grpc.Server, error) {
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	return server, nil
}

func register(kubelet, endpoint, resource string) error {
	connection, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer connection.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(connection).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
	})
	return err
}
